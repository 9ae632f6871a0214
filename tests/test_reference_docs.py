"""The README's reference block is generated from rollout_correction.reference and must match it."""

import re
from pathlib import Path

from rollout_correction import RolloutCorrectionConfig
from rollout_correction.cli import main
from rollout_correction.reference import CONFIG_KEYS, render_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_reference_block_is_current():
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- reference:start -->", 1)[1].split("<!-- reference:end -->", 1)[0]
    expected = render_markdown().split("\n", 3)[3].strip()
    assert block.strip() == expected, "run: python -m rollout_correction.reference --readme README.md"


def test_every_config_key_is_documented_and_every_preset_listed():
    assert set(CONFIG_KEYS) == set(RolloutCorrectionConfig.keys())
    text = README.read_text(encoding="utf-8")
    for name in RolloutCorrectionConfig.preset_names():
        assert re.search(rf"\| `{name}` \|", text), name


def test_presets_command_prints_every_preset(capsys):
    assert main(["presets", "--markdown"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    names = {line.split("|")[1].strip() for line in rows[1:]}  # skip the header
    assert names == set(RolloutCorrectionConfig.preset_names())
