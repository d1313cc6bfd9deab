import pytest

from pagedllm.config import EngineConfig, engine_defaults, parse_size


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
    with pytest.raises(ValueError, match="block_size"):
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


def test_the_cli_and_the_offline_api_take_the_config_defaults():
    from pagedllm.cli import build_parser
    from pagedllm.config import engine_config_from_args

    args = build_parser().parse_args(["generate", "hi"])
    assert engine_config_from_args(args) == EngineConfig()
    assert engine_defaults()["block_size"] is EngineConfig().block_size is None  # the device's


def test_the_block_size_left_unset_is_the_devices_default(tiny_model_dir):
    from pagedllm.config import default_block_size
    from pagedllm.engine.llm_engine import LLMEngine

    assert default_block_size("cpu") == 64 and default_block_size("cuda") == 16
    core = LLMEngine(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=8).engine_core
    assert core.kv_plan.block_size == core.runner.block_size == 64


def test_kv_cache_dtype_is_checked_everywhere_with_the_valid_names():
    from pagedllm.cli import build_parser

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype="int4")
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):  # argparse prints the choices
        build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "int4"])
    args = build_parser().parse_args(["generate", "hi", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.kv_cache_dtype == "fp8_e5m2"


def test_steps_are_4096_tokens_offline_and_2048_in_the_server():
    from pagedllm.cli import build_parser
    from pagedllm.config import SERVE_MAX_NUM_BATCHED_TOKENS

    assert EngineConfig().max_num_batched_tokens == 4096
    assert build_parser().parse_args(["serve"]).max_num_batched_tokens == SERVE_MAX_NUM_BATCHED_TOKENS == 2048
    custom = build_parser().parse_args(["serve", "--max-num-batched-tokens", "512"])
    assert custom.max_num_batched_tokens == 512
