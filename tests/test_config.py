"""EngineConfig: sizes, validation, and the flags derived from its fields (one each, with the
field's help, choices and default)."""

import argparse
import dataclasses
from dataclasses import dataclass, fields

import pytest

from pagedllm.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    EngineConfig,
    add_config_args,
    canonical_dtype,
    config_from_args,
    engine_config_from_args,
    flag_name,
    parse_size,
    setting,
)


@pytest.mark.parametrize("text,expected", [
    ("512MiB", 512 * 2**20), ("2GiB", 2 * 2**30), ("1.5GB", 1_500_000_000), (4096, 4096),
    ("100", 100), (" 64 kib ", 64 * 1024),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-5MiB", 0, -1, True])
def test_parse_size_rejects_nonsense(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


@pytest.mark.parametrize("block_size", [0, 3, 24, 256])
def test_block_size_must_be_a_power_of_two_up_to_128(block_size):
    with pytest.raises(ValueError, match="block_size must be one of 1, 2, 4, 8, 16, 32, 64, 128"):
        EngineConfig(block_size=block_size)


def test_engine_config_checks_every_part():
    with pytest.raises(ValueError, match="kv_layout"):
        EngineConfig(kv_layout="ring")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="memory size"):
        EngineConfig(kv_cache_memory="lots")
    with pytest.raises(ValueError, match="contiguous_reserve"):
        EngineConfig(contiguous_reserve="some")
    with pytest.raises(ValueError, match="num_kv_blocks must be a positive integer"):
        EngineConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match="distributed_timeout_s must be a positive number"):
        EngineConfig(distributed_timeout_s=0)


@pytest.mark.parametrize("name,value,words", [
    ("seed", "3", "an integer"), ("enable_prefix_caching", 1, "true or false"),
    ("batch_invariant", "yes", "true or false"), ("max_model_len", 2.5, "an integer or None"),
    ("quantization_group_size", True, "an integer"),
    ("model", 3, "a path \\(a string or os.PathLike\\) or None"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field(name, value, words):
    with pytest.raises(ValueError, match=f"{name} must be {words}; got"):
        EngineConfig(**{name: value})


def test_the_dtype_table_is_one_for_the_config_the_flags_and_the_loader():
    import torch

    from pagedllm.model.config import parse_dtype_name
    from pagedllm.model.loader import resolve_dtype

    assert DTYPES == ("auto", "float32", "bfloat16", "float16")
    for name in ("half", "fp16", "float16", torch.float16):
        assert canonical_dtype(name) == "float16"
        EngineConfig(dtype=name)
        assert resolve_dtype(name) is torch.float16 is parse_dtype_name(name)
    for bad in ("int8", "float64", torch.int64):
        with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, float16"):
            EngineConfig(dtype=bad)
    with pytest.raises(ValueError, match="float16"):  # "auto" is no model dtype
        parse_dtype_name("auto")
    dtype_flag = _actions(_parser("generate"))["dtype"]
    assert set(DTYPES) <= set(dtype_flag.choices)


# -- the flags ------------------------------------------------------------------------------------
def _parser(*command: str) -> argparse.ArgumentParser:
    """The subparser of `pagedllm COMMAND ...`."""
    from pagedllm.cli import build_parser

    parser = build_parser()
    for name in command:
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        parser = sub.choices[name]
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    by_dest: dict[str, list] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    assert all(len(actions) == 1 for actions in by_dest.values()), "two flags with one dest"
    return {dest: actions[0] for dest, actions in by_dest.items()}


@pytest.mark.parametrize("command", [("generate",), ("chat",), ("serve",), ("bench", "throughput")])
def test_every_engine_field_has_exactly_one_flag_declared_by_the_field(command):
    parser = _parser(*command)
    if command[0] == "bench":  # a bench's own flags come when it is chosen
        parser.parse_known_args(["--help-not-given"])
    actions = _actions(parser)
    for f in fields(EngineConfig):
        action = actions[f.name]
        assert flag_name(f) in action.option_strings
        assert f.metadata["help"], f"EngineConfig.{f.name} declares no help"
        assert action.help.startswith(f.metadata["help"].replace("%", "%%"))
        assert action.choices == f.metadata["choices"]
        if not (command == ("serve",) and f.name == "max_num_batched_tokens"):  # serve's own
            assert action.default == f.default
    assert actions["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert actions["distributed_timeout_s"].option_strings == ["--distributed-timeout"]
    assert actions["enable_prefix_caching"].option_strings == ["--enable-prefix-caching",
                                                                "--no-enable-prefix-caching"]


def test_the_flags_map_back_to_the_config_they_name():
    argv = ["generate", "hi", "--model", "m.gguf", "--dtype", "half", "--block-size", "16",
            "--kv-cache-memory", "2GiB", "--max-model-len", "512", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "1024", "--kv-layout", "contiguous",
            "--contiguous-reserve", "request", "--no-enable-prefix-caching", "--kv-cache-dtype", "fp8",
            "--seed", "7", "--device", "cpu", "--quantization", "int4", "--quantization-group-size", "64",
            "--generation-config", "none", "-tp", "2", "--distributed-executor-backend",
            "external_launcher", "--distributed-timeout", "5"]
    args = _parser().parse_args(argv)
    assert engine_config_from_args(args) == EngineConfig(
        model="m.gguf", dtype="half", block_size=16, kv_cache_memory="2GiB", max_model_len=512,
        max_num_seqs=8, max_num_batched_tokens=1024, kv_layout="contiguous",
        contiguous_reserve="request", enable_prefix_caching=False, kv_cache_dtype="fp8", seed=7,
        device="cpu", quantization="int4", quantization_group_size=64, generation_config="none",
        tensor_parallel_size=2, distributed_executor_backend="external_launcher",
        distributed_timeout_s=5.0)
    args = _parser().parse_args(["generate", "hi", "--batch-invariant", "--kv-cache-memory", "1000",
                                 "--num-kv-blocks", "9"])
    config = engine_config_from_args(args)
    assert (config.batch_invariant, config.kv_cache_memory, config.num_kv_blocks) == (True, 1000, 9)


def test_the_cli_and_the_offline_api_take_the_config_defaults():
    args = _parser().parse_args(["generate", "hi"])
    assert engine_config_from_args(args) == EngineConfig()
    assert EngineConfig().block_size is None  # the device's


@pytest.mark.parametrize("flags,words", [
    (["--kv-cache-memory", "lots"], "memory size must be bytes"),
    (["--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
    (["--dtype", "float64"], "invalid choice: 'float64'"),
    (["--max-num-seqs", "many"], "invalid int value"),
])
def test_a_bad_flag_is_refused_by_the_parser_saying_why(flags, words, capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["generate", "hi", *flags])
    assert words in capsys.readouterr().err


def test_a_field_added_later_gets_its_flag_with_no_more_code():
    @dataclass
    class Later(EngineConfig):
        cpu_isa: str = setting("auto", "which CPU kernels to run", choices=("auto", "avx512"))
        spill_bytes: int | None = setting(None, "bytes to spill", check=None)

    parser = argparse.ArgumentParser()
    add_config_args(parser, Later)
    args = parser.parse_args(["--cpu-isa", "avx512", "--spill-bytes", "5", "--seed", "3"])
    later = config_from_args(Later, args)
    assert (later.cpu_isa, later.spill_bytes, later.seed) == ("avx512", 5, 3)
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, avx512"):
        Later(cpu_isa="sse")

    @dataclass
    class Unparseable:
        limits: dict | None = setting(None, "no flag can say this")

    with pytest.raises(TypeError, match="Unparseable.limits: .* needs setting\\(parse=...\\)"):
        add_config_args(argparse.ArgumentParser(), Unparseable)


def test_kv_cache_dtype_is_checked_everywhere_with_the_valid_names():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert _actions(_parser("generate"))["kv_cache_dtype"].choices == KV_CACHE_DTYPES
    args = _parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.kv_cache_dtype == "fp8_e5m2"


def test_steps_are_4096_tokens_offline_and_2048_in_the_server():
    from pagedllm.config import SERVE_MAX_NUM_BATCHED_TOKENS

    assert EngineConfig().max_num_batched_tokens == 4096
    assert _parser().parse_args(["serve"]).max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS == 2048
    custom = _parser().parse_args(["serve", "--max-num-batched-tokens", "512"])
    assert custom.max_num_batched_tokens == 512
    assert "(default: 2048)" in _parser("serve").format_help().split("--max-num-batched-tokens")[-1]


def test_a_bench_setting_is_a_new_config_validated_again():
    from pagedllm.bench.common import engine_config

    args = _parser().parse_args(["bench", "memory", "--block-size", "32"])
    base = engine_config_from_args(args)
    changed = engine_config(args, block_size=16, enable_prefix_caching=False)
    assert (changed.block_size, changed.enable_prefix_caching) == (16, False)
    assert dataclasses.replace(changed, block_size=32, enable_prefix_caching=True) == base
    with pytest.raises(ValueError, match="block_size"):
        engine_config(args, block_size=3)


def test_the_block_size_left_unset_is_the_devices_default(tiny_model_dir):
    from pagedllm.config import default_block_size
    from pagedllm.engine.llm_engine import LLMEngine

    assert default_block_size("cpu") == default_block_size("cuda") == 16
    core = LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=32).engine_core
    assert core.kv_plan.block_size == core.executor.runner.block_size == 16


def test_the_start_up_line_names_every_choice_that_changes_which_code_runs(tiny_model_dir, caplog):
    from pagedllm.engine.llm_engine import LLMEngine

    with caplog.at_level("INFO", logger="pagedllm.engine.llm_engine"):
        LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=8, block_size=16,
                  kv_cache_dtype="int8", enable_prefix_caching=False, batch_invariant=True,
                  device="cpu")
    (line,) = [r.getMessage() for r in caplog.records if "KV cache" in r.getMessage()]
    for words in ("cpu, float32,", "8 blocks x 16 tokens", "KV dtype int8", "paged layout",
                  "weights", "prefix caching off", "tensor_parallel_size 1", "batch-invariant"):
        assert words in line, (words, line)


def test_the_readme_names_every_engine_flag():
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    missing = [flag_name(f) for f in fields(EngineConfig) if flag_name(f).removeprefix("--") not in readme]
    assert not missing, f"README.md's flags paragraph lacks {missing}"


def test_an_engine_takes_a_config_or_its_fields_as_keywords_not_both():
    from pagedllm.engine.llm_engine import LLMEngine

    with pytest.raises(TypeError, match="not both .*max_num_seqs"):
        LLMEngine(EngineConfig(), max_num_seqs=3)


def test_a_choice_is_of_the_fields_type_too():
    with pytest.raises(ValueError, match="block_size must be one of 1, 2, 4"):
        EngineConfig(block_size=True)  # == 1 to Python
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        EngineConfig(kv_cache_dtype=None)


def test_a_config_crosses_to_the_core_process_whole():
    """The core process decodes its EngineConfig by the annotations (msgspec): every field's type
    must be one msgspec can decode, and the config arrives equal."""
    import msgspec

    config = EngineConfig(model="m.gguf", dtype="bf16", block_size=32, kv_cache_memory="1GiB",
                          num_kv_blocks=5, max_model_len=100, enable_prefix_caching=False,
                          kv_cache_dtype="fp8", device="cpu", distributed_timeout_s=2.5,
                          batch_invariant=True)
    assert msgspec.json.decode(msgspec.json.encode(config), type=EngineConfig) == config
    assert msgspec.json.decode(msgspec.json.encode(EngineConfig(kv_cache_memory=10**9)),
                               type=EngineConfig).kv_cache_memory == 10**9


def test_a_model_path_may_be_a_path_offline():
    from pathlib import Path

    assert EngineConfig(model=Path("m.gguf")).model == Path("m.gguf")
