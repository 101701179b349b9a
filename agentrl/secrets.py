"""Secrets (API keys, tokens, key files) come from the environment, never from a config file or the
run folder.

``read_secret("AGENTRL_ENGINE_API_KEY")`` returns the variable's value, or the stripped content of
the file ``AGENTRL_ENGINE_API_KEY_FILE`` names (the Docker and Kubernetes convention); an empty
string means no secret. The config names the variables, so a resolved config can be written and
logged without leaking anything.
"""

from __future__ import annotations

import os
from pathlib import Path


class SecretError(ValueError):
    """A secret's file is named but cannot be read."""


def read_secret(env_var: str) -> str:
    """The secret named by ``env_var`` (or the file named by ``<env_var>_FILE``); "" when unset."""
    if not env_var:
        return ""
    value = os.environ.get(env_var, "")
    if value:
        return value.strip()
    file_name = os.environ.get(f"{env_var}_FILE", "")
    if not file_name:
        return ""
    try:
        return Path(file_name).read_text(encoding="utf-8").strip()
    except OSError as e:
        raise SecretError(f"{env_var}_FILE names {file_name!r}, which cannot be read: {e}") from None
    except UnicodeDecodeError as e:
        raise SecretError(f"{env_var}_FILE names {file_name!r}, which is not UTF-8 text (byte {e.start})") from None


def bearer(token: str) -> dict[str, str]:
    """The HTTP header that carries ``token`` (none when the token is empty)."""
    return {"Authorization": f"Bearer {token}"} if token else {}
