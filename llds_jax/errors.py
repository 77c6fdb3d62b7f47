"""The one base class for errors in the user's input: a config value, a file's content or path.

Each subclass is raised with a message that names the field, file or value at fault, so
``llds_jax.main`` prints that message alone (no traceback) and exits with status 2.
Anything else that escapes a mode is a bug and keeps its traceback.
"""


class InputError(ValueError):
    """Bad input the user can fix; the message names the field, file or value."""
