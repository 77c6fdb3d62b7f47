"""The roofline tool's own tests: its scripts import their siblings by bare name, as when run as
``python tools/roofline/roofline.py``, so the tool's folder goes on ``sys.path`` here."""

import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[3] / "tools" / "roofline"
if str(TOOL) not in sys.path:
    sys.path.insert(0, str(TOOL))
