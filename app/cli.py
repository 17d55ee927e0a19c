"""The `spool` command (and `python -m app`): serve, generate, bench.

Settings are read before anything heavy is imported: --threads sizes the thread pools that
NumPy's OpenBLAS and numba start with as they load.
"""

import argparse
import sys

from app import flags, peer_flags, settings, version

COMMANDS = {
    "serve": (flags.serve_arguments, "serve the OpenAI-compatible API over HTTP and WebSocket",
              "Serve the OpenAI-compatible API (HTTP with SSE, and WebSocket). Every flag is also SPOOL_<FLAG>"
              " in the environment (SPOOL_MAX_NUM_SEQS=8) and a key of --config FILE.yaml (max-num-seqs: 8);"
              " a flag wins over the environment, which wins over the file."),
    "generate": (flags.generate_arguments, "chat with the model once, streaming the reply to the terminal",
                 "Apply the model's chat template to PROMPT and stream the reply. No server."),
    "bench": (flags.bench_arguments, "offline throughput: many requests through the engine at once",
              "Submit --num-prompts random prompts at once to the engine (no HTTP) and report requests/s and"
              " tokens/s, as `vllm bench throughput` does."),
}


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (its usage is a screenful for serve)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def command_parser(command: str, prog: str) -> argparse.ArgumentParser:
    add, _, description = COMMANDS[command]
    parser = Parser(prog=f"{prog} {command}", description=description, allow_abbrev=False)
    add(parser)
    settings.add_arguments(parser)
    return parser


def top_parser(prog: str) -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description="Spool: a small LLM inference server.", allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    for name, (_, help_text, _) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def parse(argv: list[str], environ=None, prog: str = "spool") -> tuple[str, argparse.Namespace, dict]:
    """The command, its settings and each one's source. Exits 2 with argparse's usage line on a
    bad flag, as any CLI does; a bad environment or config value raises SettingsError."""
    if not argv or argv[0] not in COMMANDS:
        top_parser(prog).parse_args(argv)  # prints help or the usage error, and exits
    command, rest = argv[0], argv[1:]
    parser = command_parser(command, prog)
    notes = []
    if command == "serve":  # vLLM's and llama-server's flags, as their users copy them
        try:
            rest, notes = peer_flags.screen(rest, set(parser._option_string_actions))
        except ValueError as e:
            raise settings.SettingsError(str(e)) from None
    args, sources = settings.resolve(parser, rest, environ)
    args.peer_notes = notes
    if getattr(args, "model_arg", None) is not None:
        if sources["model"] == "command line" and args.model != args.model_arg:
            parser.error(f"the model is given twice: {args.model_arg!r} and --model {args.model!r}")
        args.model, sources["model"] = args.model_arg, "command line"
    return command, args, sources


def use_threads(args) -> None:
    """--threads, before NumPy or numba is imported (they size their pools as they load)."""
    if args.threads is not None:
        from model.threads import set_thread_count

        set_thread_count(args.threads)


def main(argv=None, prog: str = "spool") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        command, args, sources = parse(argv, prog=prog)
    except settings.SettingsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print("# each setting, its value and where it came from: command line > SPOOL_* > --config file > default")
        print(settings.describe(command_parser(command, prog), args, sources))
        return 0
    if args.threads is not None and args.threads < 1:
        print("error: --threads must be at least 1", file=sys.stderr)
        return 2
    use_threads(args)

    from model.errors import ModelError

    try:
        if command == "serve":
            from app.serve import run_serve

            return run_serve(args)
        if command == "generate":
            from app.generate import run_generate

            return run_generate(args)
        from app.bench import run_bench

        return run_bench(args)
    except ModelError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a value that can never work, said in one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
