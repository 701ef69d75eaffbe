"""Reading the TOML files users hand to convoy (configs, node profiles)."""
from __future__ import annotations

import sys
from typing import Any

from convoy.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def read_toml(path: str, label: str) -> dict[str, Any]:
    """The table in ``path``; UsageError "<label> <path> does not exist / is not valid TOML" otherwise."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"{label} {path} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{label} {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:   # a binary file
        raise UsageError(f"{label} {path} is not valid TOML: not UTF-8 text") from None
