"""Loading the agent's configuration: layers, typing, checks, messages, and the docs."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import get_origin, get_type_hints

import pytest

from kvwatch.collect.bpf.loader import SEND_MODES
from kvwatch.collect.collectors import BACKENDS
from kvwatch.config.load import (
    MAX_CONFIG_BYTES,
    RENAMED_KEYS,
    config_keys,
    config_to_dict,
    env_name,
    load_config,
    parse_flag,
)
from kvwatch.config.schema import RANGES, AgentConfig, CollectorConfig, PolicyConfig, Range
from kvwatch.errors import ConfigError
from kvwatch.streams.states import StallThresholds

DOCS = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvwatch.toml"
    path.write_text(text)
    return str(path)


def error_of(
    path: str | None = None,
    env: dict[str, str] | None = None,
    flags: dict[str, object] | None = None,
) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, env or {}, flags or {})
    return str(raised.value)


def test_nothing_given_means_the_defaults() -> None:
    config = load_config(None, {}, {})
    assert config == AgentConfig()
    assert config.policy.mode == "observe"
    assert config.policy.actions == ("cancel",)
    assert (config.policy.stall_seconds, config.policy.grace_seconds) == (3.0, 2.0)
    assert config.policy.max_cancels_per_minute == 10
    assert config.hook.socket == "/run/kvwatch/engine.sock"
    assert config.hook.allowed_uids == (0,)
    assert (config.http.host, config.http.port) == ("127.0.0.1", 9431)
    assert config.audit.path == "/var/log/kvwatch/audit.jsonl"
    assert (config.path.procfs, config.path.sysfs) == ("/proc", "/sys")
    assert config.collector == CollectorConfig(max_sockets=16384)


def test_flags_win_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '[policy]\nmode = "enforce"\nstall_seconds = 5\nmin_kv_bytes = 1048576\n'
        "[collector]\nports = [8000, 8001]\n",
    )
    env = {"KVWATCH_POLICY_STALL_SECONDS": "4.5", "KVWATCH_POLICY_MIN_KV_BYTES": "2048"}
    config = load_config(path, env, {"policy.min_kv_bytes": 0, "policy.grace_seconds": None})
    assert config.policy.mode == "enforce"  # file
    assert config.policy.stall_seconds == 4.5  # environment over file
    assert config.policy.min_kv_bytes == 0  # flag over environment
    assert config.policy.grace_seconds == 2.0  # None: flag not given
    assert config.collector.ports == (8000, 8001)


def test_environment_values_are_typed_and_lists_are_comma_separated() -> None:
    env = {
        "KVWATCH_COLLECTOR_PORTS": " 8000, 8001 ,",
        "KVWATCH_POLICY_ACTIONS": "reset,cancel",
        "KVWATCH_POLICY_DENY_CGROUPS": "/system.slice/*",
        "KVWATCH_HOOK_ALLOWED_UIDS": "",
        "KVWATCH_AUDIT_PATH": "",
        "KVWATCH_HTTP_LISTEN": "[::1]:9500",
    }
    config = load_config(None, env, {})
    assert config.collector.ports == (8000, 8001)
    assert config.policy.actions == ("reset", "cancel")
    assert config.policy.deny_cgroups == ("/system.slice/*",)
    assert config.hook.allowed_uids == ()
    assert config.audit.path == ""
    assert (config.http.host, config.http.port) == ("::1", 9500)


def test_variables_of_other_sections_are_not_ours() -> None:
    env = {"KVWATCH_ENGINE_SOCKET": "/tmp/x.sock", "KVWATCH_REQUIRE_BPF": "1", "HOME": "/root"}
    assert load_config(None, env, {}) == AgentConfig()


def test_a_mistyped_variable_of_our_sections_is_an_error_with_a_suggestion() -> None:
    message = error_of(env={"KVWATCH_POLICY_STALL_SECOND": "3"})
    assert "unknown environment variable KVWATCH_POLICY_STALL_SECOND" in message
    assert "did you mean KVWATCH_POLICY_STALL_SECONDS?" in message


def test_unknown_keys_and_sections_in_the_file_are_errors_with_a_suggestion(
    tmp_path: Path,
) -> None:
    message = error_of(write(tmp_path, "[policy]\nstall_second = 3\n"))
    assert "unknown key policy.stall_second in" in message
    assert "did you mean policy.stall_seconds?" in message
    assert "did you mean [policy]?" in error_of(write(tmp_path, "[polcy]\nmode = 'observe'\n"))
    assert "did you mean collector.ports?" in error_of(write(tmp_path, "[policy]\nports = []\n"))
    assert "must be a table" in error_of(write(tmp_path, "policy = 3\n"))
    assert "(known: http.listen)" in error_of(write(tmp_path, "[http]\nzzzz = 1\n"))
    assert "(sections: policy, collector," in error_of(write(tmp_path, "[zzzz]\n"))
    message = error_of(env={"KVWATCH_PATH_QQQQQQ": "/x"})
    assert message.endswith("(known: KVWATCH_PATH_PROCFS, KVWATCH_PATH_SYSFS)")


def test_a_renamed_key_still_loads_under_its_old_name_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "[collector]\nsend_hook = 'kprobe'\n")
    with caplog.at_level(logging.WARNING, logger="kvwatch.config"):
        assert load_config(path, {}, {}).collector.send_mode == "kprobe"
    assert f"collector.send_hook is now collector.send_mode (in {path})" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvwatch.config"):
        config = load_config(None, {"KVWATCH_COLLECTOR_SEND_HOOK": "raw_tp"}, {})
    assert config.collector.send_mode == "raw_tp"
    assert "KVWATCH_COLLECTOR_SEND_HOOK is now KVWATCH_COLLECTOR_SEND_MODE" in caplog.text


def test_an_unknown_flag_key_is_an_error() -> None:
    assert "did you mean policy.mode?" in error_of(flags={"policy.mod": "enforce"})
    assert "(sections: policy," in error_of(flags={"mode": "enforce"})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "policy.stall_seconds",
            -1,
            "policy.stall_seconds must be > 0 and <= 86400 seconds (got -1,",
        ),
        ("policy.stall_seconds", 86401, "must be > 0 and <= 86400 seconds (got 86401,"),
        ("policy.stall_seconds", 10**400, "must be a number (got 1000000"),
        ("policy.stall_seconds", "soon", "policy.stall_seconds must be a number (got 'soon',"),
        ("policy.stall_seconds", float("nan"), "must be a number (got nan,"),
        ("policy.stall_seconds", True, "must be a number (got True,"),
        ("policy.mode", "enforcing", "policy.mode must be one of observe, enforce"),
        ("policy.actions", ("cancel", "kill"), "policy.actions must be a list of any of cancel"),
        ("policy.actions", (), "policy.actions must be a non-empty list"),
        ("policy.actions", ("reset", "reset"), "without repeats"),
        ("policy.min_kv_bytes", 1.5, "policy.min_kv_bytes must be an integer (got 1.5,"),
        ("policy.min_kv_bytes", -1, "policy.min_kv_bytes must be 0..1125899906842624 bytes"),
        ("policy.grace_seconds", -0.5, "policy.grace_seconds must be 0..86400 seconds"),
        (
            "policy.max_cancels_per_minute",
            0,
            "max_cancels_per_minute must be 1..1000000 actions (use",
        ),
        ("policy.max_cancels_per_minute", int("9" * 400), "must be 1..1000000 actions"),
        ("policy.min_reader_bytes_per_second", 0, "must be 1..1073741824 bytes per second"),
        ("policy.deny_ports", (0,), "policy.deny_ports must be a list of ports 1..65535"),
        ("policy.allow_comms", ("",), "policy.allow_comms must be a list of non-empty glob"),
        ("collector.ports", tuple(range(1, 18)), "a list of at most 16 ports"),
        ("collector.ports", 8000, "collector.ports must be a list of integers (got 8000,"),
        ("collector.backend", "ebpf", "collector.backend must be one of auto, core, bcc, diag"),
        ("collector.send_mode", "tp", "collector.send_mode must be one of auto, fentry"),
        ("collector.pid", -3, "collector.pid must be 0..4194304 (0 = every process"),
        ("collector.pid", 2**32, "collector.pid must be 0..4194304"),
        ("collector.max_sockets", 0, "collector.max_sockets must be 1..268435456 (the kernel"),
        ("collector.max_sockets", 2**28 + 1, "the kernel's limit for a BPF hash map"),
        ("hook.socket", "engine.sock", "hook.socket must be an absolute path"),
        ("hook.allowed_uids", (-1,), "hook.allowed_uids must be a list of uids 0..4294967294"),
        ("hook.socket", "/run/\0.sock", "an absolute path of at most 4095 characters, without NUL"),
        ("audit.path", "/var/log/\0", "audit.path must be a path of at most 4095 characters"),
        ("policy.deny_cgroups", ("x" * 4096,), "glob patterns of at most 4095 characters"),
        ("http.listen", "\n:80", "http.listen must be host:port"),
        ("http.listen", "9431", "http.listen must be host:port"),
        ("http.listen", "localhost:70000", "http.listen must be host:port"),
        ("path.procfs", "proc", "path.procfs must be an absolute path"),
        ("streams.history_size", -1, "streams.history_size must be 0..100000 finished streams"),
        ("streams.history_size", 10**30, "streams.history_size must be 0..100000"),
    ],
)
def test_bad_values_name_the_key_the_value_and_what_is_allowed(
    key: str, value: object, expected: str
) -> None:
    message = error_of(flags={key: value})
    assert expected in message
    assert "from the command line" in message


def test_an_error_says_where_the_bad_value_came_from(tmp_path: Path) -> None:
    env_message = error_of(env={"KVWATCH_POLICY_STALL_SECONDS": "-1"})
    assert env_message == (
        "policy.stall_seconds must be > 0 and <= 86400 seconds (got '-1', from "
        "$KVWATCH_POLICY_STALL_SECONDS) (change $KVWATCH_POLICY_STALL_SECONDS)"
    )
    path = write(tmp_path, "[policy]\nstall_seconds = -1\n")
    assert f"(got -1, in {path}) (edit {path})" in error_of(path)
    assert "must be an integer (got '3.0'," in error_of(env={"KVWATCH_COLLECTOR_PID": "3.0"})
    assert "must be an integer (got 3.0, in" in error_of(
        write(tmp_path, "[collector]\npid = 3.0\n")
    )


def test_an_unreadable_or_broken_file_is_a_config_error(tmp_path: Path) -> None:
    assert "cannot read config file" in error_of(str(tmp_path / "missing.toml"))
    assert "is not valid TOML" in error_of(write(tmp_path, "[policy\n"))


def test_the_effective_config_shows_as_plain_data_and_loads_back() -> None:
    config = load_config(
        None,
        {"KVWATCH_COLLECTOR_PORTS": "8000", "KVWATCH_POLICY_MODE": "enforce"},
        {"policy.actions": ("cancel", "reset"), "policy.deny_comms": ("nginx",)},
    )
    shown = config_to_dict(config)
    assert shown["collector"]["ports"] == [8000]
    assert shown["policy"]["actions"] == ["cancel", "reset"]
    flat = {f"{section}.{key}": v for section, table in shown.items() for key, v in table.items()}
    assert sorted(flat) == sorted(config_keys())
    assert load_config(None, {}, flat) == config


def test_the_stream_state_threshold_follows_the_policy() -> None:
    policy = load_config(None, {"KVWATCH_POLICY_STALL_SECONDS": "1.5"}, {}).policy
    assert StallThresholds.of_policy(policy).stall_seconds == 1.5
    assert not policy.enforce
    assert PolicyConfig(mode="enforce").enforce


def test_choices_match_what_the_collector_accepts() -> None:
    assert "collector.backend must be one of " + ", ".join(BACKENDS) in error_of(
        flags={"collector.backend": "x"}
    )
    assert ", ".join(("auto", *SEND_MODES)) in error_of(flags={"collector.send_mode": "x"})


def test_the_documented_example_is_the_defaults_and_every_variable_is_documented(
    tmp_path: Path,
) -> None:
    text = DOCS.read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.DOTALL)
    assert example is not None
    assert load_config(write(tmp_path, example.group(1)), {}, {}) == AgentConfig()
    documented = set(re.findall(r"`(KVWATCH_[A-Z_]+)`", text))
    wanted = {env_name(key) for key in config_keys()}
    assert wanted <= documented
    renamed = {env_name(old) for old in RENAMED_KEYS}  # documented as the old names
    assert documented - wanted == {"KVWATCH_ENGINE_SOCKET", "KVWATCH_REQUIRE_BPF", *renamed}


def numeric_keys() -> set[str]:
    """The settings that are numbers, or lists of numbers."""
    hints = {
        f"{section}.{name}": hint
        for section, cls in get_type_hints(AgentConfig).items()
        for name, hint in get_type_hints(cls).items()
    }
    numbers = (int, float, tuple[int, ...])
    return {key for key, hint in hints.items() if hint in numbers}


def test_every_numeric_setting_has_one_documented_range() -> None:
    assert set(RANGES) == numeric_keys()
    rows = {
        row.split("|")[2].strip(): row
        for row in DOCS.read_text().splitlines()
        if row.startswith("| `KVWATCH_")
    }
    for key, bounds in RANGES.items():
        assert bounds.span in rows[key].split("|")[4], (key, bounds.span)


# Settings bound by another one as well as by their range: what lets their whole range load.
COMPANIONS: dict[str, dict[str, object]] = {
    "policy.release_seconds": {"policy.pause_seconds": RANGES["policy.pause_seconds"].high},
}


@pytest.mark.parametrize(("key", "bounds"), sorted(RANGES.items()))
def test_each_range_holds_at_its_ends_and_not_past_them(key: str, bounds: Range) -> None:
    is_list = get_origin(config_field(key)) is tuple
    for value, fine in (
        (bounds.low, not bounds.above_low),
        (bounds.high, True),
        (bounds.high + 1, False),
    ):
        flags: dict[str, object] = {key: (value,) if is_list else value}
        flags.update(COMPANIONS.get(key, {}))
        if fine:
            load_config(None, {}, flags)
        else:
            assert bounds.span in error_of(flags=flags)


def config_field(key: str) -> object:
    section, _, name = key.partition(".")
    return get_type_hints(get_type_hints(AgentConfig)[section])[name]


def test_a_flag_is_checked_by_the_rules_of_the_file_and_the_environment() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_flag("collector.pid", "4294967296", "--pid")
    assert str(raised.value) == (
        "collector.pid must be 0..4194304 (0 = every process; 4194304 is the kernel's pid limit) "
        "(got '4294967296', from --pid) (change --pid)"
    )
    env_message = error_of(env={"KVWATCH_COLLECTOR_PID": "4294967296"})
    assert env_message.startswith(str(raised.value).partition("(got")[0])
    assert parse_flag("collector.ports", ("8000", " 8001"), "--port") == (8000, 8001)
    with pytest.raises(ConfigError, match="at most 16 ports"):
        parse_flag("collector.ports", tuple(str(port) for port in range(1, 18)), "--port")
    assert parse_flag("policy.stall_seconds", "0.05", "--stall-seconds") == 0.05


def test_a_config_file_is_read_only_when_it_is_a_small_regular_file(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = {
        str(fifo): "is a FIFO, not a regular file",
        "/dev/zero": "is a character device, not a regular file",
        str(tmp_path): "is a directory, not a regular file",
        "": "the config file path is empty",
        "/tmp/a\0b": "embedded null byte",
    }
    for path, words in refused.items():
        assert words in error_of(path)
    big = tmp_path / "big.toml"
    big.write_bytes(b"#" * (MAX_CONFIG_BYTES + 1))
    assert "larger than 1048576 bytes (1 MiB)" in error_of(str(big))
    big.write_bytes(b"#" * MAX_CONFIG_BYTES)
    assert load_config(str(big), {}, {}) == AgentConfig()


def test_what_the_parser_cannot_take_is_a_config_error(tmp_path: Path) -> None:
    cases = {
        b"[streams]\nhistory_size = " + b"9" * 5000: "is not valid TOML: Exceeds the limit",
        b"[policy]\ndeny_ports = " + b"[" * 2000 + b"]" * 2000: "nests arrays or tables too deeply",
        b"[policy]\nmode = 1\n\xff": "is not UTF-8 text (byte 0xff at offset 18)",
        b'[policy]\ndeny_comms = ["' + b"x" * 5000 + b'"]': "(got ['xxxxxxxxxxxxxxxx",
        b'[collector]\nbackend = "' + b"\\n" * 5000 + b'"': r"(got '\n\n\n",
    }
    path = tmp_path / "kvwatch.toml"
    for data, words in cases.items():
        path.write_bytes(data)
        message = error_of(str(path))
        assert words in message
        # One short line, whatever the value, besides the file's path (shown whole, twice).
        assert "\n" not in message and len(message.replace(str(path), "")) < 300, message[:500]


def test_the_release_bound_must_lie_below_the_pause_bound() -> None:
    message = error_of(flags={"policy.release_seconds": 2.0})
    assert "policy.release_seconds 2.0 must be below policy.pause_seconds 2.0" in message
    load_config(None, {}, {"policy.release_seconds": 2.0, "policy.pause_seconds": 3.0})
