"""pagedllm.envs: every environment variable the package reads is declared there, read only there,
and parsed with a clear error."""

import ast
import logging
import os
import re
from pathlib import Path

import pytest

import pagedllm
from pagedllm import envs

PACKAGE = Path(pagedllm.__file__).parent
# engine/core_process.py's test hooks read the environment until they leave production code.
READ_ELSEWHERE = {"envs.py", "engine/core_process.py"}


def _package_sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text(encoding="utf-8")


def _reads_environment(source: str) -> bool:
    """Whether a module touches os.environ, os.getenv or os.putenv (or imports them by name)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "environb"):
            return True
        if isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                alias.name in ("environ", "getenv", "putenv") for alias in node.names):
            return True
    return False


def test_only_the_settings_module_reads_the_environment():
    readers = {name for name, source in _package_sources() if _reads_environment(source)}
    assert readers <= READ_ELSEWHERE, sorted(readers - READ_ELSEWHERE)
    assert "envs.py" in readers


def test_the_probe_sees_every_way_of_reading_it():
    for source in ("import os\nos.environ.get('X')", "from os import environ", "import os\nos.getenv('X')"):
        assert _reads_environment(source)
    assert not _reads_environment("import os\nos.getpid()")


def test_every_pagedllm_variable_the_package_names_is_declared():
    named = set()
    for _, source in _package_sources():
        named.update(re.findall(r"\bPAGEDLLM_[A-Z0-9_]*[A-Z0-9]\b", source))
    undeclared = named - set(envs.VARIABLES) - {"PAGEDLLM_CORE_TEST_HOOKS"}
    assert not undeclared, sorted(undeclared)
    for var in envs.VARIABLES.values():
        assert var.meaning, var.name


def test_values_are_parsed_as_declared(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", "/tmp/kernels")
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S", "12.5")
    monkeypatch.setenv("PAGEDLLM_DENSE_AMX", "off")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert envs.PAGEDLLM_CACHE_DIR == Path("/tmp/kernels")
    assert envs.PAGEDLLM_KERNEL_BUILD_TIMEOUT_S == 12.5
    assert envs.PAGEDLLM_DENSE_AMX is False
    assert envs.LOCAL_WORLD_SIZE == 4
    monkeypatch.delenv("PAGEDLLM_DENSE_AMX")
    assert envs.PAGEDLLM_DENSE_AMX is True  # the default
    with pytest.raises(AttributeError):
        getattr(envs, "PAGEDLLM_NO_SUCH_THING")  # noqa: B009


def test_an_empty_value_is_unset_but_for_a_secret(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S", "")
    monkeypatch.setenv("PAGEDLLM_API_KEY", "")
    assert envs.PAGEDLLM_KERNEL_BUILD_TIMEOUT_S == 900.0
    assert envs.PAGEDLLM_API_KEY == ""  # refused by pagedllm.server.keys, not taken for no key
    assert not envs.is_set("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S")


@pytest.mark.parametrize("name,value,words", [
    ("PAGEDLLM_ATTENTION", "triton", "auto or torch"),
    ("PAGEDLLM_ATTENTION_AMX", "maybe", "1 or 0"),
    ("PAGEDLLM_KERNEL_BUILD_TIMEOUT_S", "-3", "a positive number of seconds"),
    ("RANK", "zero", "an integer"),
])
def test_a_bad_value_names_the_variable_and_what_it_takes(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}='{value}': expected {words}"):
        envs.read(name)


def test_process_defaults_leave_the_users_value(monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    envs.apply_process_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == "7"
    monkeypatch.delenv("GOMP_SPINCOUNT")
    envs.apply_process_defaults()
    assert os.environ["GOMP_SPINCOUNT"] == envs.PROCESS_DEFAULTS["GOMP_SPINCOUNT"]


def test_a_child_runs_this_pagedllm(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = envs.child_environ({"EXTRA": "1"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(PACKAGE.parent), "/elsewhere"]
    assert env["EXTRA"] == "1"
    assert envs.child_environ(this_package=False)["PYTHONPATH"] == "/elsewhere"


def test_an_unknown_pagedllm_variable_is_warned_about_once_at_start(monkeypatch, caplog):
    from pagedllm.cli import main

    monkeypatch.setenv("PAGEDLLM_ATENTION", "torch")  # a typo
    monkeypatch.setenv("PAGEDLLM_CORE_TEST_HOOKS", "")  # read elsewhere
    assert envs.undeclared_pagedllm_variables() == ["PAGEDLLM_ATENTION"]
    with caplog.at_level(logging.WARNING, logger="pagedllm.cli"):
        assert main(["generate", "hi", "--model", "/nowhere/at/all"]) == 2
    (record,) = [r for r in caplog.records if "PAGEDLLM_ATENTION" in r.getMessage()]
    assert "reads no such environment variable" in record.getMessage()
