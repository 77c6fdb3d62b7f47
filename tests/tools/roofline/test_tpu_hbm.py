"""tools/roofline/_tpu_hbm.py: HBM bytes of one XLA:TPU decode token. The charging rules on a small
module written in the syntax libtpu prints (memory spaces in the layouts, ``slice-start`` with
its source in a nested tuple, ``copy-start`` as (destination, source, context)), the kernel's
DMAs from its block schedule by hand, and the whole model on real decode loops compiled for a
v5e from this CPU host (compile-only)."""

from __future__ import annotations

import os

import _tpu_hbm  # tools/roofline, on sys.path by this folder's conftest.py
import pytest

from llds_jax.plan.targets import target_installed

pytestmark = pytest.mark.unit

needs_tpu = pytest.mark.skipif(bool(target_installed("tpu")), reason=target_installed("tpu") or "installed")

# One decode-loop body in libtpu's syntax (lines shaped after `compiled.as_text()` of the real
# program): a weight prefetched into VMEM in two slices and read by a dot from VMEM, an embedding
# lookup from an HBM table, an in-place token write into an HBM buffer, a VMEM->HBM eviction, a
# nested loop of 4 trips reading an HBM buffer, and the paged decode kernel over HBM pools
# (8 rows, a 4-column block table, 32 blocks of 128 slots).
MODULE = """HloModule jit_decode_loop, is_scheduled=true

%fused_computation.1 (param_0.1: bf16[8,576], param_1.1: bf16[576,1536]) -> bf16[8,1536] {
  %param_0.1 = bf16[8,576]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %param_1.1 = bf16[576,1536]{1,0:T(8,128)(2,1)S(1)} parameter(1)
  ROOT %convolution.1 = bf16[8,1536]{1,0:T(8,128)(2,1)S(1)} convolution(%param_0.1, %param_1.1), dim_labels=bf_io->bf
}

%fused_computation.2 (param_0.2: f32[8,64], param_1.2: f32[8,1], param_2.2: s32[]) -> f32[8,64] {
  %param_0.2 = f32[8,64]{0,1:T(8,128)} parameter(0)
  %param_1.2 = f32[8,1]{0,1:T(1,128)S(1)} parameter(1)
  %param_2.2 = s32[]{:T(128)S(6)} parameter(2)
  %constant.1 = s32[]{:T(128)} constant(0)
  ROOT %dynamic-update-slice.1 = f32[8,64]{0,1:T(8,128)} dynamic-update-slice(%param_0.2, %param_1.2, %constant.1, %param_2.2)
}

%fused_computation.3 (param_0.3: bf16[49152,576], param_1.3: s32[8]) -> bf16[8,576] {
  %param_0.3 = bf16[49152,576]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.3 = s32[8]{0:T(128)S(1)} parameter(1)
  ROOT %gather.1 = bf16[8,576]{1,0:T(8,128)(2,1)S(1)} gather(%param_0.3, %param_1.3), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,576}
}

%region_add (a.1: f32[], b.1: f32[]) -> f32[] {
  %a.1 = f32[]{:T(128)} parameter(0)
  %b.1 = f32[]{:T(128)} parameter(1)
  ROOT %add.9 = f32[]{:T(128)} add(%a.1, %b.1)
}

%inner_body (arg_tuple.2: (s32[], f32[8,256])) -> (s32[], f32[8,256]) {
  %arg_tuple.2 = (s32[]{:T(128)}, f32[8,256]{1,0:T(8,128)}) parameter(0)
  %get-tuple-element.20 = s32[]{:T(128)} get-tuple-element(%arg_tuple.2), index=0
  %get-tuple-element.21 = f32[8,256]{1,0:T(8,128)} get-tuple-element(%arg_tuple.2), index=1
  %constant.5 = f32[]{:T(128)} constant(0)
  %reduce.1 = f32[8]{0:T(128)S(1)} reduce(%get-tuple-element.21, %constant.5), dimensions={1}, to_apply=%region_add
  %constant.6 = s32[]{:T(128)} constant(1)
  %add.1 = s32[]{:T(128)} add(%get-tuple-element.20, %constant.6)
  ROOT %tuple.20 = (s32[]{:T(128)}, f32[8,256]{1,0:T(8,128)}) tuple(%add.1, %get-tuple-element.21)
}

%inner_cond (arg_tuple.3: (s32[], f32[8,256])) -> pred[] {
  %arg_tuple.3 = (s32[]{:T(128)}, f32[8,256]{1,0:T(8,128)}) parameter(0)
  %get-tuple-element.30 = s32[]{:T(128)} get-tuple-element(%arg_tuple.3), index=0
  %constant.7 = s32[]{:T(128)} constant(4)
  ROOT %lt.1 = pred[]{:T(512)} compare(%get-tuple-element.30, %constant.7), direction=LT
}

%body (arg_tuple.0: (bf16[576,1536], f32[8,64], bf16[32,3,128,64], bf16[32,3,128,64], bf16[49152,576], /*index=5*/s32[8], f32[8,1], s32[], f32[8,256])) -> (bf16[576,1536], f32[8,64], bf16[32,3,128,64], bf16[32,3,128,64], bf16[49152,576], /*index=5*/s32[8], f32[8,1], s32[], f32[8,256]) {
  %arg_tuple.0 = (bf16[576,1536]{1,0:T(8,128)(2,1)}, f32[8,64]{0,1:T(8,128)}, bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}, bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}, bf16[49152,576]{1,0:T(8,128)(2,1)}, /*index=5*/s32[8]{0:T(128)S(1)}, f32[8,1]{0,1:T(1,128)S(1)}, s32[]{:T(128)S(6)}, f32[8,256]{1,0:T(8,128)S(1)}) parameter(0)
  %get-tuple-element.1 = bf16[576,1536]{1,0:T(8,128)(2,1)} get-tuple-element(%arg_tuple.0), index=0
  %slice-start.1 = ((bf16[576,1536]{1,0:T(8,128)(2,1)}), bf16[288,1536]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%get-tuple-element.1), slice={[0:288], [0:1536]}
  %slice-start.2 = ((bf16[576,1536]{1,0:T(8,128)(2,1)}), bf16[288,1536]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%get-tuple-element.1), slice={[288:576], [0:1536]}
  %get-tuple-element.5 = bf16[49152,576]{1,0:T(8,128)(2,1)} get-tuple-element(%arg_tuple.0), index=4
  %get-tuple-element.6 = s32[8]{0:T(128)S(1)} get-tuple-element(%arg_tuple.0), index=5
  %gather_fusion.1 = bf16[8,576]{1,0:T(8,128)(2,1)S(1)} fusion(%get-tuple-element.5, %get-tuple-element.6), kind=kCustom, calls=%fused_computation.3
  %slice-done.1 = bf16[288,1536]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.1)
  %slice-done.2 = bf16[288,1536]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.2)
  %custom-call.1 = bf16[576,1536]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done.1, %slice-done.2), custom_call_target="ConcatBitcast", backend_config={"flag_configs":[],"scoped_memory_configs":[],"used_scoped_memory_configs":[],"aliasing_operands":{"lists":[]}}
  %fusion.1 = bf16[8,1536]{1,0:T(8,128)(2,1)S(1)} fusion(%gather_fusion.1, %custom-call.1), kind=kOutput, calls=%fused_computation.1, metadata={op_name="jit(decode)/while/body/dot_general"}
  %get-tuple-element.2 = f32[8,64]{0,1:T(8,128)} get-tuple-element(%arg_tuple.0), index=1
  %get-tuple-element.7 = f32[8,1]{0,1:T(1,128)S(1)} get-tuple-element(%arg_tuple.0), index=6
  %get-tuple-element.8 = s32[]{:T(128)S(6)} get-tuple-element(%arg_tuple.0), index=7
  %fusion.2 = f32[8,64]{0,1:T(8,128)} fusion(%get-tuple-element.2, %get-tuple-element.7, %get-tuple-element.8), kind=kLoop, calls=%fused_computation.2, output_to_operand_aliasing={{}: (0, {})}
  %get-tuple-element.9 = f32[8,256]{1,0:T(8,128)S(1)} get-tuple-element(%arg_tuple.0), index=8
  %copy-start.1 = (f32[8,256]{1,0:T(8,128)}, f32[8,256]{1,0:T(8,128)S(1)}, u32[]{:S(2)}) copy-start(%get-tuple-element.9)
  %copy-done.1 = f32[8,256]{1,0:T(8,128)} copy-done(%copy-start.1)
  %constant.3 = s32[]{:T(128)} constant(0)
  %tuple.3 = (s32[]{:T(128)}, f32[8,256]{1,0:T(8,128)}) tuple(%constant.3, %copy-done.1)
  %while.2 = (s32[]{:T(128)}, f32[8,256]{1,0:T(8,128)}) while(%tuple.3), condition=%inner_cond, body=%inner_body, metadata={op_name="jit(decode)/while/body/while"}
  %get-tuple-element.3 = bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%arg_tuple.0), index=2
  %get-tuple-element.4 = bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%arg_tuple.0), index=3
  %fusion.10 = s32[8]{0:T(128)S(1)} fusion(%get-tuple-element.6), kind=kLoop, calls=%fused_computation.4
  %q.1 = bf16[8,3,3,64]{3,2,1,0:T(4,128)(2,1)S(1)} bitcast(%fusion.1)
  %k.1 = bf16[8,3,1,64]{3,2,1,0:T(2,128)(2,1)S(1)} bitcast(%fusion.1)
  %v.1 = bf16[8,3,1,64]{3,2,1,0:T(2,128)(2,1)S(1)} bitcast(%fusion.1)
  %table.1 = s32[32]{0:T(128)S(1)} bitcast(%fusion.1)
  %paged_decode_attention.1 = (bf16[8,3,3,64]{3,2,1,0:T(4,128)(2,1)S(1)}, bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}, bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}) custom-call(%fusion.10, %get-tuple-element.6, %fusion.10, %fusion.10, %fusion.10, /*index=5*/%fusion.10, %table.1, %q.1, %k.1, %v.1, /*index=10*/%get-tuple-element.3, %get-tuple-element.4), custom_call_target="tpu_custom_call", output_to_operand_aliasing={{1}: (10, {}), {2}: (11, {})}
  ROOT %tuple.1 = (bf16[576,1536]{1,0:T(8,128)(2,1)}, f32[8,64]{0,1:T(8,128)}) tuple(%get-tuple-element.1, %fusion.2)
}

%fused_computation.4 (param_0.4: s32[8]) -> s32[8] {
  %param_0.4 = s32[8]{0:T(128)S(1)} parameter(0)
  ROOT %negate.1 = s32[8]{0:T(128)S(1)} negate(%param_0.4)
}

ENTRY %main.1 (cache.1: bf16[32,3,128,64]) -> bf16[32,3,128,64] {
  %cache.1 = bf16[32,3,128,64]{2,3,1,0:T(8,128)(2,1)} parameter(0)
  %copy.1 = bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)} copy(%cache.1)
  %tuple.0 = (bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}) tuple(%copy.1)
  %while.1 = (bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}) while(%tuple.0), condition=%inner_cond, body=%body, metadata={op_name="jit(decode)/while"}
  ROOT %get-tuple-element.0 = bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%while.1), index=0
}
"""
WEIGHT, ROWS, UPDATE, EVICTED = 576 * 1536 * 2, 8 * 576 * 2, 8 * 1 * 4, 8 * 256 * 4
CACHE = 32 * 3 * 128 * 64 * 2  # one layer's k pool


def test_instructions_parse_with_nested_tuple_shapes_and_memory_spaces():
    op = _tpu_hbm.parse_instruction(
        "  %slice-start.1 = ((bf16[576,1536]{1,0:T(8,128)(2,1)}), bf16[288,1536]{1,0:T(8,128)(2,1)S(1)}, "
        "s32[]{:S(2)}) slice-start(%get-tuple-element.1), slice={[0:288], [0:1536]}")
    assert (op.name, op.opcode, op.operands) == ("slice-start.1", "slice-start", ["get-tuple-element.1"])
    assert [(leaf.dims, leaf.space, leaf.hbm) for leaf in op.leaves] == [
        ((576, 1536), 0, True), ((288, 1536), 1, False), ((), 2, False)]
    copy = _tpu_hbm.parse_instruction("  %copy-start.160 = (bf16[1,576]{1,0:T(2,128)(2,1)S(1)}, "
                                      "bf16[1,576]{1,0:T(2,128)(2,1)}, u32[]{:S(2)}) copy-start(%get-tuple-element.2)")
    assert [leaf.space for leaf in copy.leaves] == [1, 0, 2]  # (destination in VMEM, source in HBM, context)
    computations, entry = _tpu_hbm.parse_module(MODULE)
    assert entry == "main.1" and _tpu_hbm.decode_loop_body(_tpu_hbm.Reader(MODULE)) == "body"
    assert set(computations["body"]) >= {"slice-start.1", "paged_decode_attention.1", "while.2"}


def test_an_instruction_running_over_lines_neither_ends_its_computation_nor_is_lost():
    # A Pallas kernel's kernel_metadata is a JSON string with newlines (splash attention's, as libtpu
    # prints it): its continuation lines start with "}}", which once ended the computation there and
    # dropped everything after it (a whole update's dots and optimizer: 1.1 GB counted of 23.5 GB).
    module = """HloModule jit_update, is_scheduled=true

ENTRY %main.2 (a.1: bf16[16,9,256,64], b.1: f32[1024,576]) -> f32[1024,576] {
  %a.1 = bf16[16,9,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %b.1 = f32[1024,576]{1,0:T(8,128)} parameter(1)
  %splash.1 = bf16[16,9,256,64]{3,2,1,0:T(8,128)(2,1)} custom-call(%a.1), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 256, \\"block_kv\\": 256}"
}}, metadata={op_name="jit(update)/splash_mha_fwd/pallas_call"}
  %copy.1 = f32[1024,576]{0,1:T(8,128)} copy(%b.1), metadata={op_name="jit(update)/transpose"}
  ROOT %copy.2 = f32[1024,576]{1,0:T(8,128)} copy(%copy.1)
}
"""
    computations, entry = _tpu_hbm.parse_module(module)
    assert list(computations[entry]) == ["a.1", "b.1", "splash.1", "copy.1", "copy.2"]
    splash = computations[entry]["splash.1"]
    assert (splash.opcode, splash.operands) == ("custom-call", ["a.1"]) and "pallas_call" in splash.attrs
    kernel, matrix = 16 * 9 * 256 * 64 * 2, 1024 * 576 * 4
    charged = {c.name: c.bytes for c in _tpu_hbm.Reader(module).charges(entry)}
    assert charged == {"splash.1": 2 * kernel, "copy.1": 2 * matrix, "copy.2": 2 * matrix}, charged


def test_a_layer_slice_of_a_stacked_weight_in_a_nested_fusion_is_charged_the_slice():
    # XLA:TPU fuses layer i's slice of a [30, 576, 1536] weight stack into a fusion inside the
    # matmul's fusion (a log-prob pass's MLP, as libtpu prints it): the matmul reads one layer,
    # 1.77 MB, not the 53 MB stack. A second operand read whole by the same nested fusion is
    # charged whole.
    module = """HloModule jit_logprobs, is_scheduled=true

%slice_of_layer (param_0.1: bf16[30,576,1536]) -> bf16[576,1536,1] {
  %param_0.1 = bf16[30,576,1536]{2,1,0:T(8,128)(2,1)} parameter(0)
  %slice.1 = bf16[1,576,1536]{2,1,0:T(8,128)(2,1)} slice(%param_0.1), slice={[7:8], [0:576], [0:1536]}
  ROOT %bitcast.1 = bf16[576,1536,1]{1,0,2:T(8,128)(2,1)} bitcast(%slice.1)
}

%scaled (param_0.2: bf16[1024,576], param_1.2: bf16[576]) -> bf16[1024,576] {
  %param_0.2 = bf16[1024,576]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.2 = bf16[576]{0:T(1024)(128)(2,1)} parameter(1)
  %broadcast.1 = bf16[1024,576]{1,0:T(8,128)(2,1)} broadcast(%param_1.2), dimensions={1}
  ROOT %multiply.1 = bf16[1024,576]{1,0:T(8,128)(2,1)} multiply(%param_0.2, %broadcast.1)
}

%matmul (param_0.3: bf16[30,576,1536], param_1.3: bf16[1024,576], param_2.3: bf16[576]) -> bf16[1024,1536] {
  %param_1.3 = bf16[1024,576]{1,0:T(8,128)(2,1)} parameter(1)
  %param_2.3 = bf16[576]{0:T(1024)(128)(2,1)} parameter(2)
  %fusion.2 = bf16[1024,576]{1,0:T(8,128)(2,1)} fusion(%param_1.3, %param_2.3), kind=kLoop, calls=%scaled
  %param_0.3 = bf16[30,576,1536]{2,1,0:T(8,128)(2,1)} parameter(0)
  %fusion.3 = bf16[576,1536,1]{1,0,2:T(8,128)(2,1)} fusion(%param_0.3), kind=kLoop, calls=%slice_of_layer
  ROOT %convolution.1 = bf16[1024,1536]{1,0:T(8,128)(2,1)} convolution(%fusion.2, %fusion.3), dim_labels=bf_io0->bf
}

ENTRY %main.3 (w.1: bf16[30,576,1536], x.1: bf16[1024,576], g.1: bf16[576]) -> bf16[1024,1536] {
  %w.1 = bf16[30,576,1536]{2,1,0:T(8,128)(2,1)} parameter(0)
  %x.1 = bf16[1024,576]{1,0:T(8,128)(2,1)} parameter(1)
  %g.1 = bf16[576]{0:T(1024)(128)(2,1)} parameter(2)
  ROOT %fusion.1 = bf16[1024,1536]{1,0:T(8,128)(2,1)} fusion(%w.1, %x.1, %g.1), kind=kOutput, calls=%matmul
}
"""
    layer, rows, gains, out = 576 * 1536 * 2, 1024 * 576 * 2, 576 * 2, 1024 * 1536 * 2
    found = _tpu_hbm.hbm_of_program(module, ideal=layer + rows + out)
    assert found["bytes"] == layer + rows + gains + out, found
    assert found["by_opcode"] == {"fusion": layer + rows + gains + out} and found["kernel_calls"] == 0


def test_each_rule_charges_the_hbm_side_once_on_a_hand_written_body():
    reader = _tpu_hbm.Reader(MODULE)
    charges = {}
    for charge in reader.charges("body"):
        charges[charge.name] = charges.get(charge.name, 0) + charge.bytes
    assert charges == {
        "slice-start.1": WEIGHT / 2, "slice-start.2": WEIGHT / 2,  # the weight read once, in two slices
        "gather_fusion.1": ROWS,        # 8 rows of the HBM table, not the table
        "fusion.2": UPDATE,             # the in-place token write, not the [8, 64] buffer
        "copy-start.1": EVICTED,        # the eviction's HBM side (the write), once
        "reduce.1": 4 * (EVICTED + 4),  # an HBM read inside a nested loop of 4 trips (+ its f32[] init)
        "add.1": 4 * 12,                # the loop counter: scalars with no memory space are charged too
    }, charges  # the dot (fusion.1) reads VMEM only; the kernel is left to kernel_dma_bytes
    assert reader.notes == []
    (kernel,) = reader.kernels
    assert (kernel.batch, kernel.kv_heads, kernel.blocks, kernel.columns, kernel.head_dim, kernel.group,
            kernel.block) == (8, 3, 32, 4, 64, 3, 128)
    assert (kernel.pool_hbm, kernel.q_hbm, kernel.new_hbm, kernel.out_hbm) == ((True, True), False, (False, False), False)


def test_the_per_call_layout_copy_is_set_up_not_per_token():
    found = _tpu_hbm.hbm_per_token(MODULE, live=256)
    assert found["setup_per_call"] == 2 * CACHE  # ENTRY's copy reads and writes the pool once per call
    assert found["xla_ops"] == WEIGHT + ROWS + UPDATE + 5 * EVICTED + 4 * (4 + 12)


def test_kernel_dmas_follow_the_block_schedule_by_hand():
    shape = _tpu_hbm.KernelShape(batch=8, kv_heads=3, blocks=32, columns=4, head_dim=64, group=3, block=128,
                                 itemsize=2, pool_hbm=(True, True), q_hbm=True, new_hbm=(True, True), out_hbm=True)
    row = 64 * 2
    # per (row, KV head): 2 key + 2 value blocks of 128 slots; the new slot's 16-slot tile read and
    # written back for k and v; 3 query heads in, 3 out; the new k and v in
    per_head = 2 * 2 * 128 * row + 2 * 2 * 16 * row + 2 * 3 * row + 2 * row
    assert _tpu_hbm.kernel_dma_bytes(shape, live=256) == 8 * 3 * per_head
    assert _tpu_hbm.kernel_dma_bytes(shape, live=129) == _tpu_hbm.kernel_dma_bytes(shape, live=256)
    assert _tpu_hbm.kernel_dma_bytes(shape, live=128) == _tpu_hbm.kernel_dma_bytes(shape, live=256) - 8 * 3 * 2 * 128 * row
    assert _tpu_hbm.kernel_dma_bytes(shape, live=4096) == _tpu_hbm.kernel_dma_bytes(shape, live=512)  # 4 columns a row
    in_vmem = _tpu_hbm.KernelShape(8, 3, 32, 4, 64, 3, 128, 2, (False, False), False, (False, False), False)
    assert _tpu_hbm.kernel_dma_bytes(in_vmem, live=256) == 0  # a pool XLA keeps in VMEM moves no HBM bytes


# ------------------------------------------------------------------ real decode loops, compile-only v5e
# SmolLM2-135M's layer shapes, 8 layers: too big for XLA:TPU to keep every weight in VMEM across
# the loop (so it streams them, prefetching slices), small enough to compile in ~10 s.
LAYERS, BATCH, LIVE, SMALL, LARGE = 8, 8, 256, 1024, 4096


def _roofline():
    import roofline  # noqa: PLC0415  (on first use: it measures nothing at import, but pulls in the planner)

    return roofline


@pytest.fixture(scope="module")
def loops():
    """{slots: optimised HLO} of the engine's greedy decode loop at two pool sizes (every row's table
    covering ``slots`` cache slots, the pool holding every row's blocks), and the config."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # compile-only: claim no chip
    from llds_jax.models.testing import tiny_config

    roofline = _roofline()
    config = tiny_config("llama", dtype="bfloat16", param_dtype="float32", scan_layers=False, hidden_size=576,
                         intermediate_size=1536, num_layers=LAYERS, num_heads=9, num_kv_heads=3, head_dim=64,
                         vocab_size=49152, max_position_embeddings=8192)
    device, _ = roofline.target_device("tpu")
    hlo = {}
    for slots in (SMALL, LARGE):
        mesh, _, args, _ = roofline.build_program("decode", config, device, batch=BATCH, slots=slots)
        compiled, _ = roofline.compile_for(_tpu_hbm.decode_loop, args, dict(width=16, sampling_mode="greedy"), mesh,
                                           device.platform)
        hlo[slots] = compiled.as_text()
    return hlo, config


@pytest.mark.integration
@needs_tpu
def test_a_weight_xla_prefetches_into_vmem_is_charged_one_hbm_read(loops):
    hlo, _ = loops
    reader = _tpu_hbm.Reader(hlo[SMALL])
    body = _tpu_hbm.decode_loop_body(reader)
    ops = reader.computations[body]
    charged = {c.name: c.bytes for c in reader.charges(body)}
    prefetched: dict[str, float] = {}  # HBM weight -> bytes its slice-start/copy-start are charged
    for op in ops.values():
        if op.opcode in ("slice-start", "copy-start") and ops[op.operands[0]].opcode == "get-tuple-element":
            source = ops[op.operands[0]].leaves[0]
            if source.hbm and source.dtype == "bf16" and len(source.dims) >= 2:
                prefetched[op.operands[0]] = prefetched.get(op.operands[0], 0) + charged.get(op.name, 0)
    assert len(prefetched) >= LAYERS, f"XLA:TPU no longer prefetches weights into VMEM here: {len(prefetched)}"
    for name, nbytes in prefetched.items():
        assert nbytes == ops[name].leaves[0].bytes, (name, nbytes, ops[name].leaves[0])  # once, not at both ends
        readers = [op.name for op in ops.values() if name in op.operands
                   and op.opcode not in {"slice-start", "copy-start", "tuple"}]  # the ROOT tuple carries it on
        assert not readers, f"{name} is also read from HBM by {readers}"


@pytest.mark.integration
@needs_tpu
def test_the_cache_size_moves_no_whole_cache_and_the_kernel_reads_live_blocks(loops):
    hlo, config = loops
    found = {slots: _tpu_hbm.hbm_per_token(text, LIVE) for slots, text in hlo.items()}
    for slots, text in hlo.items():
        reader = _tpu_hbm.Reader(text)
        body = _tpu_hbm.decode_loop_body(reader)
        pool = (BATCH * slots // 128, config.num_kv_heads, 128, config.head_dim)
        ops = reader.computations[body]
        for charge in reader.charges(body):
            op = ops.get(charge.name)
            touched = [leaf.dims for leaf in (op.leaves if op else [])] + [
                leaf.dims for name in (op.operands if op else []) for leaf in reader.leaves_of(body, name)]
            assert pool not in touched and (1, *pool) not in touched, \
                f"{charge.name} ({charge.opcode}) charged {charge.bytes} on a whole pool"
        assert found[slots]["kernels"] == LAYERS and found[slots]["kernel_caches_in_hbm"] > 0
    # 4x the pool: the per-token bytes move by much less than one more pass over the extra slots
    # (XLA's VMEM residency choices shift a few MB; the kernel's mask grows by 4 bytes a slot a row).
    extra_pass = 2 * LAYERS * BATCH * config.num_kv_heads * config.head_dim * 2 * (LARGE - SMALL)
    assert abs(found[LARGE]["bytes"] - found[SMALL]["bytes"]) < 0.25 * extra_pass, (found[SMALL], found[LARGE])


@pytest.mark.integration
@needs_tpu
def test_the_kernel_dmas_are_its_block_schedule_over_the_hbm_caches(loops):
    hlo, config = loops
    reader = _tpu_hbm.Reader(hlo[LARGE])
    reader.charges(_tpu_hbm.decode_loop_body(reader))
    assert len(reader.kernels) == LAYERS
    for kernel in reader.kernels:
        assert (kernel.batch, kernel.kv_heads, kernel.blocks, kernel.columns, kernel.head_dim) == (
            BATCH, config.num_kv_heads, BATCH * LARGE // 128, LARGE // 128, config.head_dim)
        assert (kernel.group, kernel.block, kernel.itemsize) == (config.num_heads // config.num_kv_heads, 128, 2)
    in_hbm = sum(k.pool_hbm.count(True) for k in reader.kernels)
    block = BATCH * config.num_kv_heads * 128 * config.head_dim * 2  # one 128-slot block, every (row, KV head)

    def dma(live):
        return sum(_tpu_hbm.kernel_dma_bytes(k, live) for k in reader.kernels)

    assert dma(LIVE + 1) - dma(LIVE) == in_hbm * block  # one more block per HBM cache past a block edge
    assert dma(LIVE - 127) == dma(LIVE)                 # 129..256 live slots: the same two blocks
    assert dma(LARGE) - dma(LIVE) == in_hbm * block * (LARGE - LIVE) // 128


def test_a_cache_moved_between_memory_spaces_in_the_body_is_counted_as_cache_traffic():
    # XLA:TPU keeps a few layer caches in VMEM across the loop and may evict one to HBM per token
    # (seen in SmolLM2's greedy loop at 512 slots, and in Qwen2.5-3B's real decode loop).
    rotating = MODULE.replace("  ROOT %tuple.1 = ", (
        "  %get-tuple-element.40 = bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)S(1)} get-tuple-element(%arg_tuple.0), index=9\n"
        "  %copy-start.9 = (bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)}, bf16[32,3,128,64]{3,2,1,0:T(8,128)(2,1)S(1)}, "
        "u32[]{:S(2)}) copy-start(%get-tuple-element.40)\n  ROOT %tuple.1 = "))
    still, moved = _tpu_hbm.hbm_per_token(MODULE, live=256), _tpu_hbm.hbm_per_token(rotating, live=256)
    assert still["cache_moves"] == 0
    assert moved["cache_moves"] == CACHE and moved["xla_ops"] == still["xla_ops"] + CACHE


# ------------------------------------------------------------------ a real log-prob pass, compile-only v5e
@pytest.mark.integration
@needs_tpu
def test_a_log_prob_pass_is_charged_each_layers_weights_not_its_stack_and_its_splash_kernels():
    """The 8-layer SmolLM2-shaped log-prob pass (bf16 compute, fp32 masters): every layer's matmuls
    read their layer of the [8, …] weight stacks (a slice in a nested fusion), never the stack; the
    splash kernels are counted, one per layer; the prediction is bounded by the chip's peak."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from llds_jax.models.testing import tiny_config

    roofline = _roofline()
    config = tiny_config("llama", dtype="bfloat16", param_dtype="float32", scan_layers=False, hidden_size=576,
                         intermediate_size=1536, num_layers=LAYERS, num_heads=9, num_kv_heads=3, head_dim=64,
                         vocab_size=49152, max_position_embeddings=8192, remat="dots_saveable")
    device, _ = roofline.target_device("tpu")
    mesh, jitted, args, kwargs = roofline.build_program("logprobs", config, device, batch=4, length=256,
                                                        remat="dots_saveable", scored=80)
    compiled, _ = roofline.compile_for(jitted, args, kwargs, mesh, device.platform)
    hlo = compiled.as_text()
    found = _tpu_hbm.hbm_of_program(hlo, ideal=1.0)
    assert found["kernel_calls"] == LAYERS and found["kernel_bytes"] > 0, found["kernel_calls"]

    reader = _tpu_hbm.Reader(hlo)
    entry = reader.computations[reader.entry]
    stack_reads = []  # (charge, whole stack bytes) of each fusion reading a [LAYERS, …] bf16 weight stack
    for charge in reader.charges(reader.entry):
        op = entry.get(charge.name)
        if op is None or op.opcode != "fusion":
            continue
        stacks = [leaf for name in op.operands for leaf in reader.leaves_of(reader.entry, name)
                  if leaf.hbm and leaf.dtype == "bf16" and len(leaf.dims) >= 3 and leaf.dims[0] == LAYERS]
        if stacks and "dot_general" in charge.op_name:
            stack_reads.append((charge.bytes, sum(leaf.bytes for leaf in stacks)))
    assert len(stack_reads) >= 2 * LAYERS, len(stack_reads)  # the MLP's gate and up matmuls, at least
    assert all(charged < stack for charged, stack in stack_reads), stack_reads[:4]

    layer_params = LAYERS * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536 + 2 * 576) + 576 + 49152 * 576
    assert found["bytes"] >= 4 * layer_params, (found["bytes"], 4 * layer_params)  # the cast reads every fp32 master once
