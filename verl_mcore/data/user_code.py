"""Load a class or function from a user's Python file (data.custom_cls, reward.custom_fn, ...)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Any, Optional


def load_user_object(path: Optional[str], name: Optional[str], key: str,
                     name_field: str = "name") -> Any:
    """`name` from the Python file at `path`; `key` (and `name_field`) name the config keys in
    errors.

    The module is registered in sys.modules under a name derived from the absolute path, so
    loading the same file twice gives the same objects (and the same class identity).
    """
    if not path or not name:
        raise ValueError(f"{key}: give both {key}.path (a Python file) and {key}.{name_field} "
                         f"(got path={path!r}, name={name!r})")
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise ValueError(f"{key}.path={path!r}: no such file")
    module_name = "verl_mcore_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException as e:
            del sys.modules[module_name]
            raise ValueError(f"{key}.path={path!r}: importing the file failed: "
                             f"{type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ValueError(f"{key}.{name_field}={name!r}: {path} defines no such name (it defines {public})")
    return getattr(module, name)
