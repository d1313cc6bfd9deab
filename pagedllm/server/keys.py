"""Where `pagedllm serve` takes its API key from: --api-key, a file (--api-key-file), or the
environment (PAGEDLLM_API_KEY, or vLLM's VLLM_API_KEY), so that the key need not show in `ps`.
An empty key is refused: a server guarded by it would answer no one."""

from __future__ import annotations

from pathlib import Path

from pagedllm import envs

API_KEY_ENV = "PAGEDLLM_API_KEY"
VLLM_API_KEY_ENV = "VLLM_API_KEY"


def read_api_key(flag: str | None, key_file: str | None) -> str | None:
    """The key from the flag, else the file, else the environment; None: no key (open server).
    ValueError for two sources given at once, an unreadable file or an empty key."""
    given = [name for name, value in (("--api-key", flag), ("--api-key-file", key_file))
             if value is not None]
    if len(given) > 1:
        raise ValueError("give the API key one way: --api-key or --api-key-file, not both")
    if key_file is not None:
        try:
            lines = Path(key_file).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-key-file {key_file}: cannot read it ({exc})") from None
        return _checked(lines[0].strip() if lines else "", f"--api-key-file {key_file}")
    if flag is not None:
        return _checked(flag, "--api-key")
    for env in (API_KEY_ENV, VLLM_API_KEY_ENV):
        key = envs.read(env)
        if key is not None:
            return _checked(key, env)
    return None


def _checked(key: str, source: str) -> str:
    if not key.strip():
        raise ValueError(f"{source} is empty: an empty API key would let no client in; give a "
                         "key, or none to serve without one")
    if key != key.strip() or any(ord(c) < 0x21 or ord(c) == 0x7F for c in key):
        raise ValueError(f"{source} holds whitespace or control characters, which an "
                         "'Authorization: Bearer' header cannot carry")
    return key
