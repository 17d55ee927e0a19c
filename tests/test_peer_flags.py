"""vLLM's and llama-server's command lines through `spool serve`'s parser (app/peer_flags): every
flag of both lists (vLLM 0.34.0's parser, llama-server's README at llama.cpp 0c1e570) either
works, or is refused with one line that names it, and a peer's flag is never read as a prefix of
one of Spool's."""

import pytest

from app import cli, peer_flags, settings
from app.serve import api_keys

KNOWN = peer_flags.peer_flags()
OWN = set(cli.command_parser("serve", "spool")._option_string_actions)


def parse(*argv):
    return cli.parse(["serve", *argv], environ={})[1]


def outcome(flag: str, capsys) -> str:
    """"ok", or the one line it was refused with."""
    values = {"0": [], "?": [], "1": ["1"]}[KNOWN[flag].values]
    try:
        parse(flag, *values)
        return "ok"
    except settings.SettingsError as e:
        return str(e)
    except SystemExit:
        return capsys.readouterr().err.strip()


def test_the_lists_name_their_versions_and_hold_both_command_lines():
    from pathlib import Path

    heads = {name: (Path(peer_flags.__file__).parent / f).read_text().splitlines()[0] for name, f in
             peer_flags.LISTS.items()}
    assert "vLLM 0.34.0" in heads["vLLM"] and "0c1e570" in heads["llama-server"]
    assert {"--enable-auto-tool-choice", "--kv-cache-dtype", "-tp", "--lora-target-modules"} <= set(KNOWN)
    assert {"-ngl", "--jinja", "--cache-type-k", "--no-webui", "-hf", "--draft-max"} <= set(KNOWN)
    assert len(KNOWN) > 800


@pytest.mark.parametrize("peer", sorted(peer_flags.LISTS))
def test_every_flag_works_or_is_refused_in_one_line_naming_it(peer, capsys):
    refused = []
    for flag in sorted(f for f, known in KNOWN.items() if peer in known.peers):
        said = outcome(flag, capsys)
        if said == "ok":
            continue
        assert "\n" not in said and "unrecognized" not in said and "ambiguous" not in said, (flag, said)
        if flag not in OWN:  # a value Spool's own flag refuses is argparse's line; a peer's names it
            assert said.startswith(f"{' and '.join(KNOWN[flag].peers)}'s {flag} "), (flag, said)
            refused.append(flag)
    assert 0 < len(refused) < len([f for f in KNOWN if peer in KNOWN[f].peers])


def test_accepted_flags_are_noted_and_their_values_taken_with_them():
    args = parse("-ngl", "99", "-fa", "on", "--jinja", "--metrics", "--port", "9001", "-tp", "1")
    assert args.port == 9001
    assert [note.split(" is accepted")[0] for note in args.peer_notes] == [
        "llama-server's -ngl", "llama-server's -fa", "llama-server's --jinja", "llama-server's --metrics",
        "vLLM's -tp"]
    assert parse("-fa", "--port", "9002").port == 9002  # an optional value left alone


def test_flags_of_the_same_meaning_become_spools():
    args = parse("-hf", "Org/Name:Q4_K_M", "-hff", "m.gguf", "--no-webui", "--seed", "7", "-to", "30",
                 "--disable-prefix-caching", "--max-num-queued-reqs", "5")
    assert (args.model, args.gguf_file, args.no_ui, args.seed, args.request_timeout) == \
        ("Org/Name:Q4_K_M", "m.gguf", True, 7, 30.0)
    assert args.enable_prefix_caching is False and args.max_queue == 5 and not args.peer_notes


@pytest.mark.parametrize("argv, says", [
    (["--draft", "16"], "llama-server's --draft is not supported: how many guesses"),
    (["-tp", "2"], "vLLM's -tp is not supported: one process serves one device"),
    (["-ctkd", "q8_0"], "llama-server's -ctkd is not supported: a draft model runs on the model's own"),
    (["--lora-target-modules", "q_proj"], "vLLM's --lora-target-modules is not supported: an adapter adapts"),
    (["--temp", "0.7"], "llama-server's --temp is not supported: a request's sampling is its own"),
])
def test_refusals_say_why(argv, says):
    with pytest.raises(settings.SettingsError) as e:
        parse(*argv)
    assert str(e.value).startswith(says)


@pytest.mark.parametrize("argv", [["--max-num", "4"], ["--draft-mod", "x"], ["--gpu-mem", "0.5"], ["--nonsense"]])
def test_no_prefix_of_a_flag_is_taken_for_it(argv, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert "unrecognized arguments" in capsys.readouterr().err


def test_the_api_key_file_adds_its_keys(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# the team's\nsk-one\n\n  sk-two  \n")
    assert api_keys(parse("--api-key", "sk-zero", "--api-key-file", str(keys))) == ("sk-zero", "sk-one", "sk-two")
    (tmp_path / "empty").write_text("# none\n")
    for path, says in ((tmp_path / "empty", "holds no key"), (tmp_path / "missing", "cannot be read")):
        with pytest.raises(ValueError, match=says):
            api_keys(parse("--api-key-file", str(path)))


def test_a_seeded_server_repeats_its_unseeded_draws(tiny_dir):
    """`--seed`: two starts with one seed write the same sampled text for requests without a
    seed of their own; another seed writes another."""
    from live_server import LiveServer

    texts = []
    for seed in ("5", "5", "6"):
        server = LiveServer(str(tiny_dir), "--seed", seed, "--kv-cache-gib", "0.05")
        try:
            with server.openai_client() as client:
                texts.append([client.completions.create(model=tiny_dir.name, prompt="Once upon a time", max_tokens=16,
                                                        temperature=1.0).choices[0].text for _ in range(2)])
        finally:
            assert server.stop() == 0, server.output()
    assert texts[0] == texts[1] and texts[0] != texts[2]
