"""Start-up of a process below one where `rollout.torch_addons` found add-ons that cannot load:
marks them absent (None in `sys.modules`) before the process imports anything, then runs the
`sitecustomize` this one shadows, if there is one. Python imports it at start-up because
`rollout.torch_addons` puts this folder first on PYTHONPATH; nothing imports it by name."""

import importlib.machinery
import importlib.util
import os
import sys

for _name in os.environ.get("ROLLOUT_UNLOADABLE_ADDONS", "").split(","):
    if _name and _name not in sys.modules:
        sys.modules[_name] = None

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["sitecustomize"] = _module
    _spec.loader.exec_module(_module)
