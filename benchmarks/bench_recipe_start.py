"""Worker start for a script shaped like the LoRA recipe: torch's forkserver DataLoader vs
steadyload, each in fresh processes, interleaved.

Usage: python benchmarks/bench_recipe_start.py [--reps N] [--model-layers L] [--json out.json]

The script under test imports torch, transformers and peft at the top, defines its dataset
in ``__main__``, and under ``if __name__ == "__main__":`` builds the loader (2 workers),
then a model (a Qwen2 causal LM from a config, random weights, wrapped with LoRA), then
takes the first batch. On Python 3.11 to 3.13.7 the fork server does not preload the main
script, so each torch forkserver worker imports torch, transformers and peft again.
steadyload preloads what the script imported into the fork server, which it starts when
the loader is built, so that the imports overlap with building the model.
With ``steadyload.prestart([...])`` as the script's first statement (the recommended
recipe), the fork server imports them while the script does.
Printed: the wait for the first batch (inside ``next()``), and script start to first batch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = '''
import time
T0 = time.perf_counter()
import json, sys
sys.path.insert(0, {root!r})
if __name__ == "__main__" and sys.argv[1] == "steadyload-prestart":
    import steadyload
    steadyload.prestart(["torch", "transformers", "peft"])  # first thing, before the imports
import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import Qwen2Config, Qwen2ForCausalLM
import steadyload as sl


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return torch.arange(16) + i


if __name__ == "__main__":
    kind, layers = sys.argv[1], int(sys.argv[2])
    if kind.startswith("steadyload"):
        loader = sl.DataLoader(Tokens(), batch_size=4, num_workers=2)
    else:
        loader = torch.utils.data.DataLoader(Tokens(), batch_size=4, num_workers=2,
                                             multiprocessing_context=kind)
    t_model = time.perf_counter()
    config = Qwen2Config(vocab_size=5000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(Qwen2ForCausalLM(config), lora)
    t_iter = time.perf_counter()
    batch = next(iter(loader))
    t_first = time.perf_counter()
    print(json.dumps({{"model_s": t_iter - t_model, "wait_s": t_first - t_iter,
                      "script_s": t_first - T0}}))
'''

KINDS = ["forkserver", "fork", "steadyload", "steadyload-prestart"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-layers", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results: dict[str, list[dict[str, float]]] = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "recipe_shaped.py"
        script.write_text(SCRIPT.format(root=str(ROOT)))
        for rep in range(args.reps):
            for kind in KINDS:
                out = subprocess.run(
                    [sys.executable, str(script), kind, str(args.model_layers)],
                    capture_output=True, text=True, timeout=600, cwd=tmp,
                )
                if out.returncode:
                    raise SystemExit(f"{kind} failed:\\n{out.stderr}")
                results[kind].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"  repetition {rep + 1} done", flush=True)
    med = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in results.items()}
    base = med["forkserver"]
    print(f"\nmedians of {args.reps}; model build (in the parent) took "
          f"{med['steadyload']['model_s']:.2f} s")
    print(f"{'loader':28s} {'first-batch wait':>17s} {'ratio':>7s} "
          f"{'script start->batch':>20s} {'ratio':>7s}")
    names = {"forkserver": "torch, forkserver", "fork": "torch, fork (not GPU-safe)",
             "steadyload": "steadyload (forkserver)",
             "steadyload-prestart": "steadyload + prestart()"}
    for kind in KINDS:
        m = med[kind]
        print(f"{names[kind]:28s} {m['wait_s']:15.3f} s {m['wait_s'] / base['wait_s']:6.2f}x "
              f"{m['script_s']:18.3f} s {m['script_s'] / base['script_s']:6.2f}x")
    if args.json:
        from bench_json import write_json

        write_json(args.json, {"reps": args.reps, "model_layers": args.model_layers,
                               "medians": med, "raw": results})


if __name__ == "__main__":
    main()
