"""What the testkit's command-line tools share: their parser and the check of ``--device``."""

from __future__ import annotations

import argparse
import json
import re
import sys

import torch


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, but for flags and options whose help says what their absence means."""

    def _get_help_string(self, action):
        return action.help if action.default in (None, False) else super()._get_help_string(action)


def parser(module: str, doc: str) -> argparse.ArgumentParser:
    """A parser whose usage reads ``python -m <module>``, described by the first paragraph of the tool's
    docstring (less the command and the reST quotes), that shows every option's default in --help."""
    first = " ".join(doc.strip().split("\n\n")[0].split())
    summary = re.sub(r"^``[^`]*``:\s*", "", first).replace("``", "")
    return argparse.ArgumentParser(prog=f"python -m {module}", description=summary,
                                   formatter_class=_Formatter)


_parser = parser  # the parser itself, while a test watches the tools call it


def add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where to run: cpu, cuda or cuda:N (the default is cuda where torch sees a GPU)")


def device(prog: str, name: str) -> torch.device:
    """``--device``'s value as a torch.device; exits with one line where it cannot run here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise SystemExit(f"{prog}: --device {name}: not a device torch knows (cpu, cuda, cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "without CUDA" if torch.version.cuda is None else f"with CUDA {torch.version.cuda}, but sees no GPU"
        raise SystemExit(f"{prog}: --device {name}: no CUDA device here (torch {torch.__version__} is built {build})")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(f"{prog}: --device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def assert_help_is_complete(main, command: str, monkeypatch, capsys) -> None:
    """A tool's ``--help`` (pytest's fixtures given): it names the command to type, shows no reST, gives the whole
    first paragraph of the docstring, and every option says what it does and its default."""
    made = []
    monkeypatch.setattr(sys.modules[__name__], "parser", lambda *args: made.append(_parser(*args)) or made[-1])
    try:
        main(["--help"])
    except SystemExit as exit_:
        assert exit_.code == 0, exit_.code
    else:
        raise AssertionError(f"{command} --help did not exit")
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m {command} ") and "``" not in text, text
    (made_parser,) = made
    assert made_parser.description.endswith((".", ")")), made_parser.description  # the first paragraph, whole
    formatter = made_parser._get_formatter()
    for action in made_parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        if action.default not in (None, False, "==SUPPRESS=="):  # a flag, or an option whose absence is explained
            assert "(default: " in formatter._get_help_string(action), action.option_strings


def assert_absent_cuda_is_one_line(main, command: str, monkeypatch) -> None:
    """A tool asked for ``--device cuda`` where torch sees no GPU ends in one line naming the command, not a
    traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    try:
        main(["--device", "cuda"])
    except SystemExit as exit_:
        message = str(exit_.code)
    else:
        raise AssertionError(f"{command} --device cuda ran without a GPU")
    assert message.startswith(f"python -m {command}: --device cuda: no CUDA device here"), message
    assert "\n" not in message, message


def write_results(path: str, environment: dict, rows: list) -> None:
    """The tools' JSON: where and on what they ran, and their rows."""
    with open(path, "w") as f:
        json.dump({"environment": environment, "rows": rows}, f, indent=1)
    print(f"wrote {path}")
