"""Scripts that must not shadow packages: ``python recipes/whisper.py`` puts ``recipes/`` first on ``sys.path``,
so ``import whisper`` (openai-whisper: Whisper's and GPT-2's vocabularies) and ``find_spec("whisper")`` would find
the recipe file instead. Every recipe starts with

    sys.path[:] = without_script_folder(sys.path, __file__)

before its other imports (an assignment to ``sys.path``, which linters allow between imports)."""

from __future__ import annotations

import os
from typing import Iterable


def without_script_folder(path: Iterable[str], script: str) -> list[str]:
    """``path`` (``sys.path``) without the folder holding ``script`` (Python put it first to run the script; ""
    where the current directory is that folder), so a module next to the script never hides a package of the
    same name. Unchanged for a script imported some other way (tests load recipes by file location); the
    script's own imports are all absolute (``omni...``)."""
    folder = os.path.realpath(os.path.dirname(os.path.abspath(script)))
    return [p for p in path if os.path.realpath(os.path.abspath(p or os.curdir)) != folder]


__all__ = ["without_script_folder"]
