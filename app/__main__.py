"""Spool's command line: `python -m app serve` (the server) and `python -m app generate "prompt"`
(a quick check with no server)."""

import argparse
import sys

from model.errors import ModelError


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m app", description="Spool: a small LLM inference server.")
    sub = parser.add_subparsers(dest="command", required=True)

    from app.serve import add_arguments
    from model.backend import BACKENDS, DTYPES

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API over HTTP and WebSocket",
                           description="Serve the OpenAI-compatible API (HTTP with SSE, and WebSocket).")
    add_arguments(serve)

    gen = sub.add_parser("generate", help="chat with the model once, streaming the reply to the terminal",
                         description="Apply the model's chat template to PROMPT and stream the reply. No server.")
    gen.add_argument("prompt", help="the user message")
    gen.add_argument("--model", default=None,
                     help="a Hugging Face model directory or a .gguf file (default: SmolLM2-135M-Instruct,"
                          " downloaded and converted on first use)")
    gen.add_argument("--tokenizer", default=None, metavar="DIR", help="a directory whose tokenizer replaces the model's")
    gen.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                     help="a Jinja chat template, as a file or inline, in place of the tokenizer's own")
    gen.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0, off)")
    gen.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling (default: none)")
    gen.add_argument("--backend", choices=BACKENDS, default="auto",
                     help="auto picks cuda when CuPy is installed and sees a GPU, else cpu (numba kernels);"
                          " numpy is the plain NumPy reference (default: auto)")
    gen.add_argument("--dtype", choices=DTYPES, default="auto",
                     help="cuda: bfloat16 (auto), float16 or float32; cpu: q8_0 (auto with AVX-512), q4_k (a"
                          " Hugging Face checkpoint quantized to Q4_K while loading; a GGUF's quantized tensors keep"
                          " their types, as with q8_0) or float32 (auto without) (default: auto)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.command == "serve":
            from app.serve import run_serve

            return run_serve(args)
        if args.command == "generate":
            from app.generate import run_generate

            return run_generate(args)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
