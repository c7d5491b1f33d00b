"""Every option of every `harvest` command says what it is for in `--help`."""

import click

from harvest.cli import main


def test_every_option_has_help_text():
    bare = [
        f"harvest {name} {'/'.join(p.opts)}"
        for name, cmd in sorted(main.commands.items())
        for p in cmd.params
        if isinstance(p, click.Option) and not p.hidden and not (p.help or "").strip()
    ]
    assert bare == []
