"""Puts the build tree's Python package ($CROSSBAR_BUILD_DIR/python, default build/) first on
sys.path, so the tests run against the freshly built crossbar without `pip install`."""

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BUILD = os.environ.get("CROSSBAR_BUILD_DIR", "build")
_PY = os.path.join(_BUILD if os.path.isabs(_BUILD) else os.path.join(_ROOT, _BUILD), "python")
if os.path.isdir(os.path.join(_PY, "crossbar")):
    sys.path.insert(0, _PY)
    # Children (spawned ranks, torchrun) find the package the same way.
    os.environ["PYTHONPATH"] = _PY + os.pathsep + os.environ.get("PYTHONPATH", "")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
