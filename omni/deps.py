"""Optional dependencies: which pip extra installs each one, and one clear line when one is missing.

    gym = require("gymnasium")            # the module, or MissingDependency: 'pip install -e ".[rl]"'
    install_hint(exc)                     # that line for any exception caused by a missing optional module
"""

from __future__ import annotations

import importlib
from types import ModuleType

# import name -> (the package pip installs it from, the omni extra that brings it: pyproject.toml)
OPTIONAL: dict[str, tuple[str, str]] = {
    "gymnasium": ("gymnasium", "rl"),
    "minari": ("minari[hdf5]", "rl"),
    "h5py": ("minari[hdf5]", "rl"),  # minari reads its datasets with h5py (the hdf5 extra)
    "mujoco": ("mujoco", "rl"),  # the MuJoCo envs (Hopper-v5 ...)
    "imageio": ("imageio", "rl"),
    "espeakng_loader": ("espeakng-loader", "speech"),  # eSpeak NG for the synthetic speech
    "timm": ("timm", "interop"),
    "transformers": ("transformers", "interop"),
    "whisper": ("openai-whisper", "interop"),  # its checkpoints, and the Whisper/GPT-2 vocabularies it ships
    "tiktoken": ("tiktoken", "interop"),
    "matplotlib": ("matplotlib", "viz"),
}


class MissingDependency(ModuleNotFoundError):
    """An optional package is not installed; the message says what to install."""


def hint_for(module: str, extra: str | None = None) -> str | None:
    """'X is not installed: pip install -e ".[extra]"' for an optional module (None for other modules)."""
    package, known = OPTIONAL.get(module.split(".")[0], (module, None))
    extra = extra or known
    if extra is None:
        return None
    return f'{package} is not installed: pip install -e ".[{extra}]" (from the omni checkout)'


def require(module: str, extra: str | None = None) -> ModuleType:
    """``import module``; when it (or an optional package it imports) is missing, MissingDependency
    naming the extra that installs it (``extra``, default from OPTIONAL)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = exc.name or module
        hint = hint_for(missing, extra if missing.split(".")[0] == module.split(".")[0] else None)
        if hint is None:
            raise
        raise MissingDependency(hint, name=missing) from exc


def install_hint(exc: BaseException) -> str | None:
    """The install line when ``exc``, or an exception it was raised from, is an ImportError of an optional
    module (gymnasium's DependencyNotInstalled for MuJoCo, omni's own wrapped ImportErrors); else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, MissingDependency):
            return str(exc)
        if isinstance(exc, ImportError) and exc.name and hint_for(exc.name):
            return hint_for(exc.name)
        exc = exc.__cause__ or exc.__context__
    return None
