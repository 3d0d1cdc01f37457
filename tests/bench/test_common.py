"""Every benchmark's `-h` explains each option and shows its default."""

import argparse
import importlib

import pytest

from cluster.bench import BENCHMARKS


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_option_has_help_and_shows_its_default(name, monkeypatch, capsys):
    seen = []
    parse = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        seen.append(self)
        return parse(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit) as e:
        importlib.import_module(BENCHMARKS[name]).main(["-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mlx-fleet bench {name} ")
    (p,) = seen
    for action in p._actions:
        assert action.help, f"{name}: {action.option_strings} has no help"
        if action.option_strings and action.default is not None and action.default is not False \
                and action.default != [] \
                and action.default != argparse.SUPPRESS and "default" not in action.help:
            assert "(default: " in p.formatter_class("x")._get_help_string(action), \
                f"{name}: {action.option_strings} does not show its default"
