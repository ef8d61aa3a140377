"""Every ``LOOM_*`` setting declared once (`loom.settings`) and checked before anything starts (issue 37, item 4):
every name in the sources is declared; ``loom run`` refuses a bad value in one line, exit 2, before it starts a
worker; the library reads the same declaration (so the two cannot disagree)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from loom.settings import SETTINGS, SettingError, check_environment, setting

SRC = Path(__file__).resolve().parent.parent / "src"


@pytest.mark.unit
def test_every_loom_name_in_the_sources_is_declared():
    used = set()
    for path in SRC.rglob("*.py"):
        used |= set(re.findall(r"\bLOOM_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    missing = sorted(used - set(SETTINGS))
    assert not missing, f"LOOM_* names read in src but not declared in loom/settings.py: {missing}"


@pytest.mark.unit
def test_the_settings_page_lists_every_setting_with_its_default():
    page = (SRC.parent / "docs" / "settings.md").read_text()
    for declared in SETTINGS.values():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{declared.name}` |")), None)
        assert row is not None, f"docs/settings.md does not list {declared.name}"
        if not declared.internal and isinstance(declared.default, (int, float)):
            shown = (
                str(int(declared.default)) if isinstance(declared.default, bool) else f"{declared.default:g}"
            )
            assert f"| {shown} |" in row, f"docs/settings.md gives {declared.name} another default: {row}"


@pytest.mark.unit
@pytest.mark.parametrize(
    "name, value, expected",
    [
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "abc", "not a number of seconds"),
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "0", "expected seconds > 0"),
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "nan", "expected seconds > 0"),
        ("LOOM_HEAL_CHECKIN_TIMEOUT_S", "-1", "expected seconds > 0"),
        ("LOOM_HEAL_JOIN_WAIT_S", "abc", "not a number of seconds"),
        ("LOOM_HEAL_JOIN_WAIT_S", "-0.5", "expected seconds >= 0"),
        ("LOOM_WORK_TIMEOUT_S", "-1", "expected seconds > 0"),
        ("LOOM_HANG_TIMEOUT_S", "1e300", "<= 2.592e+06"),
        ("LOOM_ZYGOTE", "yes", "expected 0 or 1"),
        ("LOOM_STRAGGLER_WINDOW", "0", "expected an integer in 1.."),
        ("LOOM_HOROVOD_ALLREDUCE", "fast", "expected one of native"),
        ("LOOM_TRACE_STEPS", "5:2", "1 <= FIRST <= LAST"),
        ("LOOM_TRACE_STEPS", "0:3", "1 <= FIRST <= LAST"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable_the_value_and_the_fix(name, value, expected):
    with pytest.raises(SettingError) as caught:
        setting(name, {name: value})
    text = str(caught.value)
    assert (
        "\n" not in text and text.startswith(f"{name}={value!r}: ") and expected in text and "HINT: " in text
    )
    errors, _ = check_environment({name: value, "PATH": "/bin"})
    assert errors == [text]


@pytest.mark.unit
def test_unset_means_the_default_and_a_secret_is_never_echoed():
    assert setting("LOOM_HEAL_JOIN_WAIT_S", {}) == 2.0
    assert setting("LOOM_HEAL_JOIN_WAIT_S", {"LOOM_HEAL_JOIN_WAIT_S": "0"}) == 0.0
    assert setting("LOOM_ZYGOTE", {"LOOM_ZYGOTE": "0"}) is False
    with pytest.raises(SettingError) as caught:
        setting("LOOM_JOB_SECRET", {"LOOM_JOB_SECRET": "x" * 5000})
    assert "xxxx" not in str(caught.value)
    errors, warnings = check_environment({"LOOM_HANG_TIMEOUT": "30", "LOOM_RUN_DIR": "anything"})
    assert errors == [] and len(warnings) == 1 and "LOOM_HANG_TIMEOUT_S" in warnings[0]


@pytest.mark.unit
def test_the_library_reads_the_same_declaration(monkeypatch):
    from loom.fault.quorum import Quorum
    from loom.fault.timeouts import work_timeout_s
    from loom.launch.heal import HealPolicy, HealQuorum

    monkeypatch.setenv("LOOM_WORK_TIMEOUT_S", "-1")
    with pytest.raises(SettingError, match="LOOM_WORK_TIMEOUT_S='-1'"):
        work_timeout_s()
    monkeypatch.setenv("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "nan")
    with pytest.raises(SettingError, match="LOOM_HEAL_HEARTBEAT_TIMEOUT_S='nan'"):
        HealQuorum(2, HealPolicy(), None, print, bool, print)  # the launcher's side
    monkeypatch.setenv("LOOM_HEAL_JOIN_WAIT_S", "abc")
    with pytest.raises(SettingError, match="LOOM_HEAL_JOIN_WAIT_S='abc'"):
        Quorum(None, 0, 0)


@pytest.mark.system
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "name, value",
    [
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "abc"),
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "0"),
        ("LOOM_HEAL_HEARTBEAT_TIMEOUT_S", "nan"),
        ("LOOM_HEAL_CHECKIN_TIMEOUT_S", "-1"),
        ("LOOM_HEAL_JOIN_WAIT_S", "abc"),
        ("LOOM_WORK_TIMEOUT_S", "-1"),
    ],
)
def test_loom_run_refuses_a_bad_setting_before_anything_starts(tmp_path, name, value):
    from test_launcher import run_loom

    script = tmp_path / "never.py"
    script.write_text("open('started', 'w').write('yes')\n")
    result = run_loom(["run", "-n", "2", "--on-worker-failure", "heal", "--run-dir", tmp_path / "run", script],
                      tmp_path, timeout=100, env={name: value})  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"loom run: {name}={value!r}: ") and "HINT" in lines[0], (
        lines
    )
    assert not (tmp_path / "started").exists() and not (tmp_path / "run").exists()
