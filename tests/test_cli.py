"""The `spool` command's settings: every flag under each of its names, as SPOOL_<DEST> and as a
--config key reaches the same setting, with flag > environment > file > default. The table is
walked from the parsers themselves, so a flag added later is covered without a line here."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from app import cli, settings
from app.flags import name_list

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"generate": ["hello"]}  # positionals a command needs whatever the test sets


def other_value(action):
    """A value the flag accepts that is not its default, and the strings that spell it."""
    if action.choices is not None:
        value = next(c for c in action.choices if c != action.default)
    elif action.type is int:
        value = (action.default or 0) + 3
    elif action.type is float:
        value = (action.default or 0.0) + 0.25
    elif action.type is name_list:  # a list in one value, JSON on the command line as vLLM takes it
        value = ["x-" + action.dest, "y-" + action.dest]
        return value, [json.dumps(value)]
    else:
        value = "x-" + action.dest
    if isinstance(action, argparse._AppendAction):  # repeated (--lora FILE): one use, a list of what it takes
        if isinstance(action.nargs, int):
            group = [f"{value}-{k}" for k in range(action.nargs)]
            return [group], group
        return [value], [value]
    if action.nargs in ("+", "*"):
        return [value, value + "-2"], [value, value + "-2"]
    return value, [str(value)]


def cases():
    for command in cli.COMMANDS:
        parser = cli.command_parser(command, "spool")
        for action in parser._actions:
            if action.option_strings and action.dest in settings.settings(parser):
                for option in action.option_strings:
                    yield command, option, action


@pytest.mark.parametrize("command,option,action", list(cases()),
                         ids=[f"{c}{o}" for c, o, _ in cases()])
def test_every_name_env_var_and_config_key_reaches_the_same_setting(command, option, action, tmp_path):
    base = [command, *REQUIRED.get(command, [])]
    dest = action.dest
    if action.nargs == 0:  # a switch: its value is whatever naming it gives; a file turns it on by its key
        value, words, in_file = getattr(cli.parse([*base, option], environ={})[1], dest), [], True
        positive = isinstance(action, argparse.BooleanOptionalAction) and not option.startswith("--no-")
        assert positive or value != action.default, f"{option} changes nothing"
    else:
        value, words = other_value(action)
        in_file = value

    _, args, sources = cli.parse([*base, option, *words], environ={})
    assert getattr(args, dest) == value and sources[dest] == "command line"

    # the environment and the file name the setting by its dest, whatever alias the flag had
    flat = [w for v in value for w in (v if isinstance(v, list) else [v])] if isinstance(value, list) else None
    env_value = ",".join(flat) if flat is not None else str(value).lower()
    _, args, sources = cli.parse(base, environ={settings.env_name(dest): env_value})
    assert getattr(args, dest) == value and sources[dest] == settings.env_name(dest)

    config = tmp_path / "config.yaml"
    if option.startswith("--"):  # every long name is a key, in either spelling
        key = option[2:]
        for spelling in (key, key.replace("-", "_")):
            config.write_text(yaml.safe_dump({spelling: in_file}))
            _, args, sources = cli.parse([*base, "--config", str(config)], environ={})
            assert getattr(args, dest) == value and sources[dest] == str(config), spelling


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path):
    config = tmp_path / "spool.yaml"
    config.write_text("max-num-seqs: 3\nport: 9001\nhost: 0.0.0.0\n")
    env = {"SPOOL_CONFIG": str(config), "SPOOL_MAX_NUM_SEQS": "5", "SPOOL_PORT": "9002"}
    _, args, sources = cli.parse(["serve", "--max-num-seqs", "8"], environ=env)
    assert (args.max_num_seqs, sources["max_num_seqs"]) == (8, "command line")
    assert (args.port, sources["port"]) == (9002, "SPOOL_PORT")
    assert (args.host, sources["host"]) == ("0.0.0.0", str(config))
    assert (args.prefill_chunk, sources["prefill_chunk"]) == (256, "default")


def spool(*argv, env=None, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "app", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def test_print_config_shows_each_value_and_its_source(tmp_path):
    config = tmp_path / "spool.yaml"
    config.write_text("port: 9001\nserved-model-name: [alpha, beta]\napi-key: sekrit\n")
    done = spool("serve", "some/model", "--config", str(config), "-t", "2", "--print-config",
                 env={"SPOOL_MAX_NUM_SEQS": "5"})
    assert done.returncode == 0, done.stderr
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if not line.startswith("#")}
    assert rows["--model"] == ["some/model", "command", "line"]
    assert rows["--threads"] == ["2", "command", "line"]
    assert rows["--max-num-seqs"] == ["5", "SPOOL_MAX_NUM_SEQS"]
    assert rows["--port"] == ["9001", str(config)]
    assert rows["--served-model-name"] == ["alpha", "beta", str(config)]
    assert rows["--api-key"] == ["****", str(config)] and "sekrit" not in done.stdout
    assert rows["--max-num-batched-tokens"] == ["1024", "default"]
    assert set(rows) == {settings.primary_flag(a) for a in settings.settings(cli.command_parser("serve", "x")).values()}


@pytest.mark.parametrize("env,config,words", [
    ({"SPOOL_PORT": "http"}, None, ["SPOOL_PORT", "'http' is not a valid int"]),
    ({"SPOOL_BACKEND": "tpu"}, None, ["SPOOL_BACKEND", "'tpu' is not one of"]),
    ({"SPOOL_ENFORCE_EAGER": "maybe"}, None, ["SPOOL_ENFORCE_EAGER", "not a boolean"]),
    ({}, "kv-cache-gb: 1\n", ["'kv-cache-gb' is not a setting"]),
    ({}, "- port\n", ["must hold a mapping"]),
    ({}, "port: [1, 2]\n", ["port: takes one value"]),
    ({}, "port: 8000\n  bad: indent\n", ["is not valid YAML"]),
])
def test_a_bad_environment_or_config_value_is_one_line(tmp_path, env, config, words):
    argv = ["serve", "--print-config"]
    if config is not None:
        (tmp_path / "c.yaml").write_text(config)
        argv += ["--config", str(tmp_path / "c.yaml")]
    done = spool(*argv, env=env)
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and all(w in line for w in words), line


def test_the_model_given_twice_differently_is_refused_and_a_missing_config_file_named():
    done = spool("serve", "a/b", "--model", "c/d", "--print-config")
    assert done.returncode == 2 and "the model is given twice" in done.stderr
    done = spool("serve", "--config", "/no/such.yaml", "--print-config")
    assert done.returncode == 2 and "cannot read the config file /no/such.yaml" in done.stderr


THREADS = """
import ctypes, sys
from app import cli
_, args, _ = cli.parse(["serve", *sys.argv[1:]], environ={})
cli.use_threads(args)
import numpy, numba
lib = [l.split()[-1] for l in open("/proc/self/maps") if "openblas" in l.lower()][0]
blas = next(getattr(ctypes.CDLL(lib), n) for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
            "openblas_get_num_threads") if hasattr(ctypes.CDLL(lib), n))
print(numba.get_num_threads(), blas())
"""


def test_threads_sizes_numba_and_openblas_before_they_load():
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    for argv, expected in ((["-t", "1"], "1 1"), (["--threads", "2"], "2 2")):
        done = subprocess.run([sys.executable, "-c", THREADS, *argv], cwd=ROOT, capture_output=True, text=True,
                              timeout=60, env=env)
        assert done.stdout.split() == expected.split(), done.stderr


def test_zero_threads_is_refused_in_one_line():
    done = spool("serve", "-t", "0")
    assert done.returncode == 2 and done.stderr.strip() == "error: --threads must be at least 1"


def test_several_served_names_from_the_environment_and_settings_from_a_file(tiny_dir, tmp_path):
    from live_server import LiveServer

    config = tmp_path / "spool.yaml"
    config.write_text("max-num-seqs: 2\nkv-cache-gib: 0.05\nbackend: numpy\n")
    server = LiveServer(str(tiny_dir), "--config", str(config),
                        env={"SPOOL_SERVED_MODEL_NAME": "alpha,beta", "SPOOL_MAX_MODEL_LEN": "96"})
    try:
        with server.openai_client() as client:
            assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
            assert client.models.retrieve("beta").id == "beta"
            reply = client.completions.create(model="beta", prompt="hi", max_tokens=2)
            assert reply.model == "alpha"  # replies carry the first name, as vLLM's do
            import openai

            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="gamma", prompt="hi", max_tokens=2)
            info = httpx.get(server.url + "/server_info", timeout=10).json()
        assert info["max_model_len"] == 96
        assert "backend numpy" in server.output()
    finally:
        assert server.stop() == 0, server.output()


def test_bench_reports_throughput(tiny_dir):
    done = spool("bench", str(tiny_dir), "--backend", "numpy", "--num-prompts", "6", "--input-len", "8",
                 "--output-len", "5", "-np", "4")
    assert done.returncode == 0, done.stderr
    line = next(line for line in done.stdout.splitlines() if line.startswith("Throughput:"))
    requests, total, output = (float(w) for w in line.replace(",", " ").split() if w.replace(".", "").isdigit())
    assert requests > 0 and total == pytest.approx(output * (8 + 5) / 5, rel=1e-3)
    assert "6 prompts x 8 tokens in, 5 out; max-num-seqs 4" in done.stdout


def test_bench_takes_the_kv_cache_flags(tiny_dir):
    done = spool("bench", str(tiny_dir), "--backend", "cpu", "--dtype", "q8_0", "-ctk", "q8_0", "-ctv", "q8_0",
                 "--num-prompts", "2", "--input-len", "8", "--output-len", "3")
    assert done.returncode == 0, done.stderr
    assert "cpu (q8_0, q8_0 K/V)" in done.stdout
    done = spool("bench", str(tiny_dir), "--backend", "numpy", "--kv-cache-dtype", "fp8")
    assert done.returncode != 0 and "is --backend cuda's" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("argv,words", [(["serve", "--port", "http"], "argument --port: invalid int value"),
                                        (["serve", "--max-seqs"], "expected one argument"),
                                        (["serve", "--no-such-flag"], "unrecognized arguments"),
                                        (["sreve"], "invalid choice: 'sreve'")])
def test_a_bad_flag_is_one_line_not_a_screenful_of_usage(argv, words):
    done = spool(*argv)
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and line.startswith("error: ") and words in line and "--help" in line
