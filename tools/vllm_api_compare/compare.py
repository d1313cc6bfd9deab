"""Cases by outcome for run.sh's two result folders: how many each server passed, and every case vLLM
passed that pagedllm did not, with the first line of pagedllm's failure.
Usage: python3 compare.py OUT/vllm OUT/pagedllm"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def outcomes(folder: str) -> dict[str, tuple[str, str]]:
    """case id -> (passed|failed|error|skipped, first line of the message)."""
    found = {}
    for path in sorted(Path(folder, "junit").glob("*.xml")):
        for case in ET.parse(path).iter("testcase"):
            key = f"{case.get('classname')}::{case.get('name')}"
            status, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    status = "failed" if tag == "failure" else tag
                    message = (node.get("message") or node.text or "").strip().splitlines()[:1]
                    message = message[0][:200] if message else ""
                    break
            found[key] = (status, message)
    return found


def main(vllm_dir: str, pagedllm_dir: str) -> None:
    vllm, pagedllm = outcomes(vllm_dir), outcomes(pagedllm_dir)
    vllm_passed = [k for k, (s, _) in vllm.items() if s == "passed"]
    both = [k for k in vllm_passed if pagedllm.get(k, ("missing",))[0] == "passed"]
    print(f"cases: vLLM ran {len(vllm)}, passed {len(vllm_passed)}; pagedllm passed {len(both)} of those"
          f" ({sum(s == 'passed' for s, _ in pagedllm.values())} in all)")
    for key in vllm_passed:
        status, message = pagedllm.get(key, ("missing", "not run"))
        if status != "passed":
            print(f"  {status:7} {key}: {message}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
