"""``rankmem completion bash``: print a bash completion script for the command.

Written from the parser itself, so it offers exactly the subcommands, flags and flag choices this
rankmem has. Install it for the session with ``eval "$(rankmem completion bash)"``, or for good with
``rankmem completion bash > ~/.local/share/bash-completion/completions/rankmem``. zsh reads it after
``autoload -U bashcompinit && bashcompinit``. Words that are not flags complete as file names.
"""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("shell", choices=SHELLS, help="the shell to write the script for")


def _words(items: list[str]) -> str:
    return shlex.quote(" ".join(items))


def bash_script(parser: argparse.ArgumentParser) -> str:
    """The completion function for ``parser`` (the top-level ``rankmem`` parser, with its subparsers)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    top = [s for a in parser._actions for s in a.option_strings]
    cases, choice_cases = [], []
    for name, p in sub.choices.items():
        flags = [s for a in p._actions for s in a.option_strings]
        positional = [c for a in p._actions if not a.option_strings and a.choices for c in a.choices]
        cases.append(f"        {name}) words={_words(flags)}; positional={_words([str(c) for c in positional])} ;;")
        for a in p._actions:
            if a.option_strings and a.choices:
                opts = "|".join(a.option_strings)
                choice_cases.append(f"        {name}:{opts.replace('|', f'|{name}:')}) "
                                    f"COMPREPLY=($(compgen -W {_words([str(c) for c in a.choices])} -- \"$cur\")); "
                                    "return ;;")
    commands = list(sub.choices)
    return "\n".join([
        "# bash completion for rankmem: eval \"$(rankmem completion bash)\"",
        "_rankmem() {",
        "    local cur=${COMP_WORDS[COMP_CWORD]} prev=${COMP_WORDS[COMP_CWORD-1]} cmd='' i words positional",
        "    for ((i = 1; i < COMP_CWORD; i++)); do",
        "        case ${COMP_WORDS[i]} in -*) ;; *) cmd=${COMP_WORDS[i]}; break ;; esac",
        "    done",
        "    if [[ -z $cmd ]]; then",
        f"        COMPREPLY=($(compgen -W {_words(commands + top)} -- \"$cur\")); return",
        "    fi",
        "    case $cmd:$prev in",
        *choice_cases,
        "    esac",
        "    case $cmd in",
        *cases,
        "        *) return ;;",
        "    esac",
        "    if [[ $cur == -* ]]; then",
        "        COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))",
        "    elif [[ -n $positional ]]; then",
        "        COMPREPLY=($(compgen -W \"$positional\" -- \"$cur\"))",
        "    fi",
        "}",
        "complete -o default -F _rankmem rankmem",
        "",
    ])


def run(args: argparse.Namespace) -> int:
    from rankmem.cli import build_parser

    print(bash_script(build_parser()), end="")
    return 0
