"""The anchor beside tools/bench_engine.py on a GPU: Hugging Face transformers with torch (both on
the device image, neither a dependency of Spool), batch generation of the same shape, on the same
device in the same run. A model of --shape with random weights (tools/random_model.py's shapes),
greedy, every request --input-len random tokens in and exactly --output-len out, in batches of
--batch (all prompts of one length: no padding). Prints one line and, with --json, writes it.

    python tools/hf_anchor.py --shape llama3-8b --requests 512 --batch 256 --input-len 512 --output-len 256
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_model import SHAPES  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch
    import transformers

    shape = {k: v for k, v in SHAPES[args.shape].items() if k not in ("architectures", "model_type", "torch_dtype")}
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    torch.manual_seed(0)
    started = time.perf_counter()
    torch.set_default_dtype(dtype)
    with torch.device(args.device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    made = time.perf_counter() - started

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def generate(batch: int, output_len: int):
        ids = torch.randint(0, shape["vocab_size"], (batch, args.input_len), device=args.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False, pad_token_id=0)
        assert out.shape == (batch, args.input_len + output_len), out.shape

    generate(min(args.batch, args.requests), 4)  # warm
    sync()
    t0 = time.perf_counter()
    for start in range(0, args.requests, args.batch):
        generate(min(args.batch, args.requests - start), args.output_len)
    sync()
    wall = time.perf_counter() - t0
    result = {"anchor": f"transformers {transformers.__version__}, torch {torch.__version__}", "shape": args.shape,
              "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
              "requests": args.requests, "batch": args.batch, "input_len": args.input_len,
              "output_len": args.output_len, "wall_s": wall, "output_tok_s": args.requests * args.output_len / wall,
              "model_made_s": made}
    print(f"# {result['anchor']} on {result['device']}: {args.requests} x {args.input_len} in / {args.output_len} out"
          f" in batches of {args.batch}: {wall:.1f} s, {result['output_tok_s']:.0f} output tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
