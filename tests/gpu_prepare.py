"""`make gpu-prepare`: pack, here, what `make gpu-check` needs on a GPU machine that has no network
and only its own image (Python 3.12 with torch, Triton, transformers: /work/.library/device/).

What a device call carries is the working tree plus at most 64 MiB in all, so this writes three
ignored folders (docs/gpu.md gives the commands that carry them):

  .gpu-carry/    the project's dependencies the image lacks, as CPython 3.12 manylinux wheels of
                 the versions installed here (about 7.5 MB); and smollm2/, the default model's
                 config.json and tokenizer (from its GGUF): enough to build a random-weight model
                 of its shapes there
  .gpu-model-a/  the default model's GGUF (98 MB, more than one call may carry) cut in two halves,
  .gpu-model-b/  each with a manifest (its name, size and sha256): the check's call carries one
                 half and keeps it on the machine, a second call carries the other and runs what
                 needs the real weights

Run here, with this project's venv and network access to the package index:
    python -m tests.gpu_prepare
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

CARRY = Path(".gpu-carry")
MODEL_PARTS = (Path(".gpu-model-a"), Path(".gpu-model-b"))
# Imported by the check (the package, its tests, transformers' GGUF loading) and missing from the
# device image's package list (KINDS.md), with what they need that the image lacks or has too old.
WHEELS = ("gguf", "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
          "typing-inspection", "typing-extensions", "opentelemetry-api", "llguidance", "pyzmq",
          "msgspec")
# pip matches each manylinux tag exactly: the ones these packages' wheels carry.
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_26_x86_64", "manylinux_2_27_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux1_x86_64")
CALL_LIMIT_BYTES = 64 * 2**20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", default=None, help="the GGUF to cut in two (default: the default model)")
    parser.add_argument("--skip-wheels", action="store_true", help="keep the wheels already there")
    args = parser.parse_args(argv)
    from pagedllm.model.default_model import default_model_path

    gguf_path = Path(args.gguf) if args.gguf else default_model_path()
    if not args.skip_wheels:
        download_wheels(CARRY / "wheels")
    write_model_shape(gguf_path, CARRY / "smollm2")
    split_model(gguf_path, MODEL_PARTS)
    tree = tracked_bytes()
    for name, paths in (("check call", [CARRY, MODEL_PARTS[0]]), ("second call", [MODEL_PARTS[1]])):
        total = tree + sum(folder_bytes(p) for p in paths)
        print(f"{name}: {total / 2**20:.1f} MiB with the tree ({tree / 2**20:.1f} MiB); limit 64 MiB")
        if total > CALL_LIMIT_BYTES:
            print(f"  over the limit: {name} would be refused", file=sys.stderr)
            return 1
    return 0


def download_wheels(folder: Path) -> None:
    """Each package at the version installed here, as a cp312 wheel for x86-64 Linux."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    for name in WHEELS:
        pin = f"{name}=={importlib.metadata.version(name)}"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *platforms,
                        "-d", str(folder), pin], check=True)
    print(f"wheels: {len(list(folder.glob('*.whl')))} in {folder} ({folder_bytes(folder) / 2**20:.1f} MiB)")


def write_model_shape(gguf_path: Path, folder: Path) -> None:
    """The default model's config.json (transformers' reading of its GGUF) and tokenizer files
    (pagedllm's, from its GGUF metadata): a random-weight model of its shapes needs nothing else."""
    import transformers

    from pagedllm.model.gguf_file import GGUFCheckpoint
    from pagedllm.text.tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    config.save_pretrained(folder)
    tokenizer = Tokenizer.from_gguf(GGUFCheckpoint(gguf_path).metadata)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    tokens = {"bos_token": tokenizer.bos_token_id, "eos_token": tokenizer.eos_token_id}
    special = {name: tokenizer.backend.id_to_token(i) for name, i in tokens.items() if i is not None}
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {**special, "chat_template": tokenizer.chat_template}, indent=1))
    print(f"model shape: {folder} ({config.num_hidden_layers} layers, hidden {config.hidden_size})")


def split_model(gguf_path: Path, folders: tuple[Path, ...]) -> None:
    """The file in len(folders) parts of about equal size, each folder with a manifest."""
    data = gguf_path.read_bytes()
    manifest = {"name": gguf_path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "parts": len(folders)}
    step = -(-len(data) // len(folders))
    for i, folder in enumerate(folders):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir()
        (folder / f"part-{i}").write_bytes(data[i * step:(i + 1) * step])
        (folder / "manifest.json").write_text(json.dumps(manifest))
    print(f"model: {gguf_path.name} ({len(data) / 2**20:.1f} MiB) in {len(folders)} parts")


def tracked_bytes() -> int:
    """What the working tree sends besides the carried folders: tracked and untracked files that
    git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum(Path(n.decode()).stat().st_size for n in names if n and Path(n.decode()).is_file())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


if __name__ == "__main__":
    sys.exit(main())
