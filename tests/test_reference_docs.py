"""The reference block of docs/guide.md is generated from tools/reference.py and must match it."""

import re
import sys
from pathlib import Path

from rollout_correction import RolloutCorrectionConfig
from rollout_correction.cli import main
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # the docs generator
from reference import CONFIG_KEYS, render_markdown  # noqa: E402

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "guide.md"


def test_readme_reference_block_is_current():
    text = GUIDE.read_text(encoding="utf-8")
    block = text.split("<!-- reference:start -->", 1)[1].split("<!-- reference:end -->", 1)[0]
    expected = render_markdown().split("\n", 3)[3].strip()
    assert block.strip() == expected, "run: python tools/reference.py --guide docs/guide.md"


def test_every_config_key_is_documented_and_every_preset_listed():
    assert set(CONFIG_KEYS) == set(RolloutCorrectionConfig.keys())
    text = GUIDE.read_text(encoding="utf-8")
    for name in RolloutCorrectionConfig.preset_names():
        assert re.search(rf"\| `{name}` \|", text), name


def test_presets_command_prints_every_preset(capsys):
    assert main(["presets", "--markdown"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    names = {line.split("|")[1].strip() for line in rows[1:]}  # skip the header
    assert names == set(RolloutCorrectionConfig.preset_names())


CONFIG_PAGE = GUIDE.parent / "config.md"


def test_config_page_is_current():
    from reference import render_config_page

    assert CONFIG_PAGE.read_text(encoding="utf-8") == render_config_page(), \
        "run: python tools/reference.py --config-md docs/config.md"


def test_config_page_lists_every_key_and_preset_with_its_call():
    from rollout_correction_core._src.presets import PRESETS

    text = CONFIG_PAGE.read_text(encoding="utf-8")
    for key in RolloutCorrectionConfig.keys():
        assert f"| `{key}` |" in text, key
    for name, preset in PRESETS.items():
        call = f"{name}(" + ", ".join(f"{a}={d!r}" for a, d in preset.args.items()) + ")"
        assert f"| `{name}` | `{call}` |" in text, name
    assert "| `geo_mis` | `geo_mis(is_threshold=2.0, rs_threshold=1.001, rs_threshold_lower=None, " \
           "veto_threshold=0.0001)` |" in text


def test_preset_loss_label_says_ppo_clip_alone_without_is_weights():
    from reference import preset_rows

    loss = {r[0]: r[4] for r in preset_rows()}
    assert loss["decoupled_token_is"] == "ppo_clip × IS"
    assert loss["decoupled_geo_rs"] == loss["geo_rs"] == loss["disabled"] == "ppo_clip"
    assert loss["bypass_pg_is"] == "reinforce" and loss["bypass_ppo_clip"] == "ppo_clip"
