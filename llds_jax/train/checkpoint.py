"""Checkpoints that survive preemption, kill -9, mesh changes and damaged files.

Integration (the trainer's loop needs four lines)::

    ckpt = Checkpointer(workdir, keep=3, async_save=True)
    restored = resume(ckpt, config.resume, abstract_state)   # abstract leaves carry shardings
    state, extra = (restored.state, restored.extra) if restored else (fresh_state, {})
    ...
    ckpt.save(step, state, {"data": it.state_dict(), "config": config.to_dict()})
    ...
    ckpt.close()                                             # waits for the async save

When to save and stop (SIGTERM, a streak of non-finite updates) is run control, not
checkpointing: ``llds_jax.app.run_control``.

On-disk layout (``<workdir>/checkpoints``)::

    <step>/                         one finished checkpoint (Orbax CheckpointManager step dir)
      state/                        the state pytree, OCDBT/zarr, sharded by Orbax
      extra/metadata                JSON: data-iterator state, resolved config, anything host-side
      _CHECKPOINT_METADATA          Orbax's own record (commit time)
      llds_integrity.json           ours: every file's size (and crc32) once the save committed
    <step>.orbax-checkpoint-tmp-*   a save in progress; never listed, never restored

Why each piece:

* **Atomicity** comes from Orbax: a step is written under a temporary name and renamed
  (POSIX) or marked with ``commit_success.txt`` (GCS) only after every host finished, and
  ``all_steps()`` lists committed steps only. So a kill -9 mid-save leaves a tmp directory that
  resume ignores (and the next save of that step replaces).
* **Integrity manifest**: Orbax does not notice a truncated or bit-flipped data file (it
  restored silently wrong values in our probe), so once a save has committed, process 0 records
  size and crc32 of every file; restore checks them first and names the damaged file.
  ``integrity="size"`` skips the checksums (a 50 GB checkpoint on GCS is slow to hash).
* **Resharding**: restore reads straight into the shardings of the abstract state it is
  given, so a checkpoint from a (2, 4) mesh restores onto (4, 2), (1, 8) or another pod size.
* **Host-side state as JSON**: the data iterator's position is saved, not replayed by
  fast-forwarding, and the resolved config travels with the weights.
* A damaged newest checkpoint raises ``CheckpointCorruptError`` naming the file and the
  previous good step (``on_corrupt="raise"``, default: losing steps silently is worse than a
  loud stop); ``on_corrupt="previous"`` falls back to the newest intact one instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

log = logging.getLogger(__name__)

INTEGRITY_FILE = "llds_integrity.json"
STATE_ITEM = "state"
EXTRA_ITEM = "extra"
INTEGRITY_MODES = ("crc32", "size", "none")
ON_CORRUPT = ("raise", "previous")
_CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the directory or file and the reason."""


class CheckpointMismatchError(CheckpointError):
    """The restore target is not the saved tree (a leaf missing, extra, or of another shape/dtype):
    the run's config changed since the save. Checked on the saved metadata before any array is read."""


class CheckpointCorruptError(CheckpointError):
    """A committed checkpoint whose files no longer match what was written."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What ``restore`` hands back: the step, the state pytree and the host-side JSON."""

    step: int
    state: Any
    extra: dict


def abstract_like(tree: Any) -> Any:
    """``ShapeDtypeStruct`` (with sharding) for every array leaf: a restore target from live state."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def with_shardings(abstract_tree: Any, shardings: Any) -> Any:
    """Attach ``shardings`` (same tree structure) to the leaves of ``abstract_tree``."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_tree, shardings)


class Checkpointer:
    """Save and restore the training state under ``<workdir>/checkpoints``.

    Args:
      workdir: run directory (local path or ``gs://``); checkpoints go to its ``checkpoints/``.
      keep: number of newest checkpoints kept (older ones are deleted after a new one commits).
      async_save: return from ``save`` once arrays are copied to host; the write continues in
        the background and the next ``save``/``wait``/``close`` waits for it.
      integrity: ``"crc32"`` (sizes and checksums), ``"size"``, or ``"none"``.
      on_corrupt: ``"raise"`` or ``"previous"`` (fall back to the newest intact step).
    """

    def __init__(self, workdir: str | epath.PathLike, *, keep: int = 3, async_save: bool = True,
                 integrity: str = "crc32", on_corrupt: str = "raise"):
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint keep={keep!r}: must be an int >= 1")
        if integrity not in INTEGRITY_MODES:
            raise ValueError(f"checkpoint integrity={integrity!r}: expected one of {INTEGRITY_MODES}")
        if on_corrupt not in ON_CORRUPT:
            raise ValueError(f"checkpoint on_corrupt={on_corrupt!r}: expected one of {ON_CORRUPT}")
        self.directory = epath.Path(workdir) / "checkpoints"
        self.integrity = integrity
        self.on_corrupt = on_corrupt
        self._pending_manifest: list[int] = []
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options,
                                              item_names=(STATE_ITEM, EXTRA_ITEM))

    # ----------------------------------------------------------------- listing
    def all_steps(self) -> list[int]:
        """Committed steps, oldest first (a save in progress is not among them)."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> epath.Path:
        return self.directory / str(step)

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Any, extra: dict | None = None) -> None:
        """Checkpoint ``state`` (any pytree of jax arrays) and the JSON-able ``extra`` at ``step``.

        Every process must call this with the same step (Orbax writes each host's shards and
        commits once all are done). Saving a step that already exists is a no-op with a log
        line: after a resume the loop may reach the restored step's save point again.
        """
        extra = {} if extra is None else extra
        _check_json(extra)
        self._finish_pending()
        if step in self._manager.all_steps():
            log.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return
        saved = self._manager.save(step, args=ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardSave(state), EXTRA_ITEM: ocp.args.JsonSave(extra)}),
            force=True)
        if not saved:
            raise CheckpointError(f"Orbax declined to save step {step} in {self.directory}")
        self._pending_manifest.append(step)

    def wait(self) -> None:
        """Block until every started save has committed and its integrity manifest is written."""
        self._finish_pending()

    def close(self) -> None:
        self._finish_pending()
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _finish_pending(self) -> None:
        self._manager.wait_until_finished()
        pending, self._pending_manifest = self._pending_manifest, []
        if self.integrity == "none" or jax.process_index() != 0:
            return
        committed = set(self._manager.all_steps())
        for step in pending:
            if step in committed:  # keep-N may already have deleted it
                write_integrity_manifest(self.step_dir(step), checksums=self.integrity == "crc32")

    # --------------------------------------------------------------- restoring
    def restore(self, step: int, abstract_state: Any) -> Restored:
        """Read step ``step`` into the shardings carried by ``abstract_state``'s leaves.

        ``abstract_state`` is the state's tree of ``jax.ShapeDtypeStruct`` with ``sharding``
        set (e.g. ``jax.eval_shape`` of the initialiser + ``with_shardings``); the mesh may
        differ from the one the checkpoint was written on.
        """
        if step not in self.all_steps():
            raise CheckpointError(
                f"no committed checkpoint for step {step} in {self.directory} "
                f"(committed: {self.all_steps() or 'none'})")
        _require_shardings(abstract_state)
        verify_integrity(self.step_dir(step), checksums=self.integrity == "crc32")
        self._check_target(step, abstract_state)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                **{STATE_ITEM: ocp.args.StandardRestore(abstract_state),
                   EXTRA_ITEM: ocp.args.JsonRestore()}))
        except Exception as err:  # Orbax/tensorstore errors do not say which checkpoint
            raise CheckpointCorruptError(
                f"restoring {self.step_dir(step)} failed ({type(err).__name__}: {err}): either the "
                f"checkpoint is damaged or the abstract state does not match the saved tree "
                f"(same leaves, shapes, dtypes)") from err
        return Restored(step=step, state=out[STATE_ITEM], extra=dict(out[EXTRA_ITEM] or {}))

    def _check_target(self, step: int, abstract_state: Any) -> None:
        """Compare the target's leaves with the saved metadata (paths, shapes, dtypes) before reading
        any array: a mismatch names its first leaf instead of failing inside tensorstore mid-read."""
        try:
            # The item's own handler reads it: a manager that did not write this step knows no handler.
            metadata = ocp.StandardCheckpointHandler().metadata(self.step_dir(step) / STATE_ITEM)
        except Exception as err:  # metadata files missing or unreadable: the checkpoint itself is bad
            raise CheckpointCorruptError(f"{self.step_dir(step)}: its tree metadata cannot be read "
                                         f"({type(err).__name__}: {err})") from err
        saved = _leaves_by_path(getattr(metadata, "tree", metadata))
        target = _leaves_by_path(abstract_state)
        where = self.step_dir(step)
        for name, absent, present in (("the checkpoint lacks", target.keys() - saved.keys(), "target"),
                                      ("the target lacks", saved.keys() - target.keys(), "checkpoint")):
            if absent:
                raise CheckpointMismatchError(
                    f"{where}: {len(absent)} leaf/leaves of the {present} that {name}, first {sorted(absent)[0]!r}; "
                    f"was the run's config (model, optimizer, rl.kl_coef) changed since the save?")
        for path, leaf in target.items():
            old = saved[path]
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):  # saved as its raw key data
                leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
            if tuple(old.shape) != tuple(leaf.shape) or jax.numpy.dtype(old.dtype) != jax.numpy.dtype(leaf.dtype):
                raise CheckpointMismatchError(
                    f"{where}: leaf {path!r} was saved as {tuple(old.shape)} {old.dtype}, the target is "
                    f"{tuple(leaf.shape)} {leaf.dtype}; was the run's config (model, optimizer) changed since the save?")

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest committed checkpoint, or None if there is none (a fresh run).

        A damaged newest checkpoint raises (default) or, with ``on_corrupt="previous"``, is
        logged and skipped in favour of the newest intact one.
        """
        steps = self.all_steps()
        for i, step in enumerate(reversed(steps)):
            try:
                return self.restore(step, abstract_state)
            except CheckpointCorruptError as err:
                older = steps[: len(steps) - 1 - i]
                if self.on_corrupt == "raise":
                    hint = (f"move {self.step_dir(step)} aside to resume from step {older[-1]}"
                            if older else "no older checkpoint exists; start a fresh workdir")
                    raise CheckpointCorruptError(f"{err}\n  -> {hint}, or set on_corrupt='previous'") from err
                log.error("skipping damaged checkpoint step %d: %s", step, err)
        if steps:
            raise CheckpointCorruptError(f"every checkpoint in {self.directory} is damaged: {steps}")
        return None

    # ----------------------------------------------------------------- export
    def export_hf(self, step: int, model: Any, save_pretrained: Callable[..., Any] | None = None,
                  **kwargs) -> epath.Path:
        """Write the policy as a Hugging Face directory ``<workdir>/hf/step_<step>``.

        Uses ``llds_jax.models.save_pretrained(model, directory, **kwargs)`` (injectable for
        tests). Written to a temporary name and renamed, so a half-written export never looks
        complete. Only process 0 writes, so on several hosts pass a model whose arrays process 0
        can read (e.g. params gathered with ``distributed.fetch_to_host``).
        """
        if save_pretrained is None:
            from llds_jax.models import save_pretrained  # noqa: PLC0415 (models is optional here)
        target = self.directory.parent / "hf" / f"step_{step}"
        if jax.process_index() == 0:
            tmp = target.parent / f".step_{step}.tmp"
            if tmp.exists():
                tmp.rmtree()
            tmp.mkdir(parents=True)
            save_pretrained(model, str(tmp), **kwargs)
            if target.exists():
                target.rmtree()
            tmp.rename(target)
        return target


# ------------------------------------------------------------------- resume
def parse_resume(value: Any) -> str | int:
    """Normalise ``config.resume``: ``"auto"``, ``"never"``, or a step number (int or digits)."""
    if isinstance(value, bool):
        raise ValueError(f"config.resume={value!r}: expected 'auto', 'never' or a step number")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"config.resume={value}: a step number must be >= 0")
        return value
    if isinstance(value, str):
        if value in ("auto", "never"):
            return value
        if value.isdigit():
            return int(value)
    raise ValueError(f"config.resume={value!r}: expected 'auto', 'never' or a step number")


def resume(ckpt: Checkpointer, resume_setting: Any, abstract_state: Any) -> Restored | None:
    """Apply ``config.resume`` (default ``"auto"``): the restored state, or None for a fresh start.

    ``"never"`` refuses a workdir that already holds checkpoints rather than silently mixing
    two runs' checkpoints in one directory.
    """
    setting = parse_resume(resume_setting)
    if setting == "auto":
        return ckpt.restore_latest(abstract_state)
    if setting == "never":
        existing = ckpt.all_steps()
        if existing:
            raise CheckpointError(
                f"config.resume='never' but {ckpt.directory} holds checkpoints {existing}: "
                f"use a fresh workdir or config.resume=auto")
        return None
    return ckpt.restore(setting, abstract_state)


# ---------------------------------------------------------------- integrity
def _walk_files(root: epath.Path):
    for child in sorted(root.iterdir(), key=lambda p: p.name):
        if child.is_dir():
            yield from _walk_files(child)
        elif child.name != INTEGRITY_FILE:
            yield child


def _crc32(path: epath.Path) -> int:
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_integrity_manifest(step_dir: epath.Path, *, checksums: bool = True) -> None:
    """Record every file's size (and crc32) under ``step_dir``; written atomically via rename."""
    files = {}
    for path in _walk_files(step_dir):
        entry = {"size": path.stat().length}
        if checksums:
            entry["crc32"] = _crc32(path)
        files[str(path.relative_to(step_dir))] = entry
    tmp = step_dir / f".{INTEGRITY_FILE}.tmp"
    tmp.write_text(json.dumps({"version": 1, "files": files}, indent=1, sort_keys=True))
    tmp.rename(step_dir / INTEGRITY_FILE)


def verify_integrity(step_dir: epath.Path, *, checksums: bool = True) -> None:
    """Raise ``CheckpointCorruptError`` naming the first missing, resized or altered file.

    A committed step without a manifest (killed between Orbax's commit and our manifest, or
    written with ``integrity="none"``) is accepted with a warning: Orbax's commit is the
    atomicity guarantee, the manifest only adds damage detection.
    """
    manifest_path = step_dir / INTEGRITY_FILE
    if not manifest_path.exists():
        log.warning("%s has no %s; restoring without an integrity check", step_dir, INTEGRITY_FILE)
        return
    try:
        files = json.loads(manifest_path.read_text())["files"]
    except (ValueError, KeyError) as err:
        raise CheckpointCorruptError(f"{manifest_path}: unreadable integrity manifest ({err})") from err
    for rel, expected in files.items():
        path = step_dir / rel
        if not path.exists():
            raise CheckpointCorruptError(f"checkpoint file missing: {path}")
        size = path.stat().length
        if size != expected["size"]:
            raise CheckpointCorruptError(
                f"checkpoint file damaged: {path} is {size} bytes, was written as {expected['size']}")
        if checksums and "crc32" in expected and _crc32(path) != expected["crc32"]:
            raise CheckpointCorruptError(
                f"checkpoint file damaged: {path} fails its crc32 check "
                f"(got {_crc32(path):#010x}, written {expected['crc32']:#010x})")


def _check_json(extra: dict) -> None:
    if not isinstance(extra, dict):
        raise TypeError(f"checkpoint extra must be a dict of JSON values, got {type(extra).__name__}")
    for key, value in extra.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as err:
            raise TypeError(f"checkpoint extra[{key!r}] is not JSON-serialisable: {err}") from err


def _leaves_by_path(tree: Any) -> dict[str, Any]:
    """Leaves keyed by a path of plain names (attribute, key or index), the form Orbax saves a tree in."""
    def name(key) -> str:
        return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))

    return {"/".join(name(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _require_shardings(abstract_state: Any) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(abstract_state)
    for path, leaf in leaves:
        if getattr(leaf, "sharding", None) is None:
            raise CheckpointError(
                f"restore target leaf {jax.tree_util.keystr(path)} has no sharding; build the "
                f"abstract state with with_shardings(...) so each array lands where the step expects it")
