"""The built-in local node checks (``fsm_agent.plugins.node_check_local``): disk, shared memory and
a device command, on real directories, filesystems and processes (a fake device script stands in
for ``nvidia-smi``: no GPU here); their options and which checks a configuration switches on."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fsm_agent.config import LaunchConfig
from fsm_agent.node_checks import KEY_PREFIX, CheckResult, CheckRound
from fsm_agent.plugins import node_check_local as local
from fsm_agent.plugins.manager import collect_options, get_plugin_manager
from fsm_agent.plugins.node_check_local import DeviceCheck, DiskCheck, ShmCheck
from fsm_agent.settings import Rejected

pytestmark = pytest.mark.unit

FAKE_DEVICE = Path(__file__).resolve().parents[1] / "fixtures" / "fake_device_check.py"
#: A free-space threshold no test filesystem has, in GiB.
HUGE_GIB = 1e7


def check_round(timeout_s: float = 30.0) -> CheckRound:
    """A round of one node; the local checks never use the store."""
    return CheckRound(
        store=None,
        key_prefix=KEY_PREFIX,
        group_rank=0,
        group_world_size=1,
        node_addr="127.0.0.1",
        hostname="node0",
        timeout_s=timeout_s,
        deadline=time.monotonic() + timeout_s,
    )


def fake_device(*args: str) -> str:
    return shlex.join([sys.executable, str(FAKE_DEVICE), *args])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_for_pids(pid_file: Path, timeout: float = 10.0) -> list[int]:
    end = time.monotonic() + timeout
    while not pid_file.exists():
        assert time.monotonic() < end, f"{pid_file} never written"
        time.sleep(0.02)
    return [int(pid) for pid in pid_file.read_text().split()]


def assert_gone(pids: list[int], timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < end, f"still running: {[pid for pid in pids if alive(pid)]}"
        time.sleep(0.02)


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory on a read-only tmpfs: root, who passes every permission bit, cannot write it
    either (EROFS). Skipped where this process may not mount."""
    target = tmp_path / "ro"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here: {done.stderr.decode().strip()}")
    yield target
    subprocess.run(["umount", str(target)], check=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A writable 64 MiB tmpfs (its free space known); skipped where this process may not mount."""
    target = tmp_path / "small"
    target.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield target
    subprocess.run(["umount", str(target)], check=True)


# -- disk ------------------------------------------------------------------------------------------


def test_disk_ok_on_writable_directories_and_one_not_made_yet(tmp_path):
    made, later = tmp_path / "logs", tmp_path / "ckpt" / "run1"
    made.mkdir()
    result = DiskCheck([str(made), str(later)], min_free_gib=0.0).fsm_agent_node_check(check_round())
    assert result.ok, result.reason
    assert result.check == "disk" and result.reason == ""
    assert result.measurements["paths"] == 2 and result.measurements["free_gib"] > 0
    assert not later.exists(), "the check made the directory the agent makes"
    assert list(made.iterdir()) == [] and list(tmp_path.iterdir()) == [made], "the probe file was left behind"


def test_disk_path_under_a_file_fails_naming_it(tmp_path):
    (tmp_path / "file").write_text("x")
    path = tmp_path / "file" / "ckpt"
    result = DiskCheck([str(path)], min_free_gib=0.0).fsm_agent_node_check(check_round())
    assert not result.ok
    assert result.reason == f"{path} (not there yet: checked {tmp_path / 'file'}): not a directory"


def test_disk_read_only_filesystem_fails_naming_it(read_only_dir, tmp_path):
    good = tmp_path / "good"
    good.mkdir()
    result = DiskCheck([str(good), str(read_only_dir)], min_free_gib=0.0).fsm_agent_node_check(check_round())
    assert not result.ok
    assert result.reason == f"{read_only_dir}: not writable: Read-only file system"
    assert "\n" not in result.reason


def test_disk_below_min_free_fails_naming_the_path_and_both_numbers(tmp_path):
    result = DiskCheck([str(tmp_path)], min_free_gib=HUGE_GIB).fsm_agent_node_check(check_round())
    assert not result.ok
    found = re.fullmatch(
        rf"{re.escape(str(tmp_path))}: (\d+\.\d\d) GiB free, below --node-check-disk-min-free-gib 1e\+07", result.reason
    )
    assert found, result.reason
    assert float(found[1]) == pytest.approx(result.measurements["free_gib"], abs=0.01)


def test_disk_free_space_measured_exactly_on_a_small_tmpfs(small_tmpfs):
    result = DiskCheck([str(small_tmpfs)], min_free_gib=1.0).fsm_agent_node_check(check_round())
    assert result.reason == f"{small_tmpfs}: 0.06 GiB free, below --node-check-disk-min-free-gib 1"
    assert result.measurements["free_gib"] == pytest.approx(64 / 1024, abs=1e-3)
    assert DiskCheck([str(small_tmpfs)], min_free_gib=0.05).fsm_agent_node_check(check_round()).ok


def test_disk_every_bad_path_is_named_on_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    bad_a, bad_b = tmp_path / "file" / "a", tmp_path / "file" / "b"
    result = DiskCheck([str(bad_a), str(tmp_path), str(bad_b)], min_free_gib=0.0).fsm_agent_node_check(check_round())
    assert not result.ok and "\n" not in result.reason
    assert str(bad_a) in result.reason and str(bad_b) in result.reason and result.reason.count("; ") == 1


# -- shared memory -----------------------------------------------------------------------------------


def test_shm_threshold_below_free_passes_above_fails(small_tmpfs):
    result = ShmCheck(0.05, str(small_tmpfs)).fsm_agent_node_check(check_round())
    assert result.ok and result.check == "shm"
    assert result.measurements["total_gib"] == pytest.approx(64 / 1024, abs=1e-3)
    result = ShmCheck(2.0, str(small_tmpfs)).fsm_agent_node_check(check_round())
    assert not result.ok
    assert result.reason == f"{small_tmpfs}: 0.06 GiB free, below --node-check-shm-min-gib 2"


def test_shm_on_any_directory_and_a_missing_one(tmp_path):
    assert ShmCheck(0.001, str(tmp_path)).fsm_agent_node_check(check_round()).ok
    result = ShmCheck(HUGE_GIB, str(tmp_path)).fsm_agent_node_check(check_round())
    assert (
        not result.ok
        and result.reason.startswith(f"{tmp_path}: ")
        and "--node-check-shm-min-gib 1e+07" in result.reason
    )
    result = ShmCheck(1.0, str(tmp_path / "none")).fsm_agent_node_check(check_round())
    assert result.reason == f"{tmp_path / 'none'}: cannot measure shared memory: No such file or directory"


# -- device command ----------------------------------------------------------------------------------


def test_device_command_exit_0_passes():
    result = DeviceCheck(fake_device("ok"), timeout=30).fsm_agent_node_check(check_round())
    assert result == CheckResult(check="device", ok=True, measurements=result.measurements)
    assert result.measurements["command_s"] < 30


def test_device_command_failure_names_the_command_and_its_last_stderr_line():
    command = fake_device("fail")
    result = DeviceCheck(command, timeout=30).fsm_agent_node_check(check_round())
    assert not result.ok
    assert result.reason == f"`{command}` exited with 1: GPU 3: ECC errors"


def test_device_documented_gpu_count_command_sees_local_world_size(monkeypatch):
    """The module docstring's ``nvidia-smi -L`` comparison, with the fake listing two devices."""
    command = f"""test "$({fake_device("list")} | grep -c '^GPU')" -ge "$LOCAL_WORLD_SIZE" """
    monkeypatch.setenv("FAKE_GPUS", "2")
    assert DeviceCheck(command, local_world_size=2).fsm_agent_node_check(check_round()).ok
    result = DeviceCheck(command, local_world_size=4).fsm_agent_node_check(check_round())
    assert not result.ok and result.reason.startswith(f"`{command}` exited with 1")


def test_device_command_that_hangs_is_killed_with_its_children(tmp_path):
    pid_file = tmp_path / "pids"
    command = fake_device("hang", str(pid_file))
    started = time.monotonic()
    result = DeviceCheck(command, timeout=2.0).fsm_agent_node_check(check_round())
    assert time.monotonic() - started < 2.0 + 3.0
    assert result.reason == f"`{command}` did not finish within 2 s (--node-check-device-timeout)"
    assert_gone(wait_for_pids(pid_file))


def test_device_command_stops_at_the_round_deadline(tmp_path):
    pid_file = tmp_path / "pids"
    command = fake_device("hang", str(pid_file))
    result = DeviceCheck(command, timeout=300).fsm_agent_node_check(check_round(timeout_s=1.5))
    assert re.fullmatch(
        rf"`{re.escape(command)}` did not finish within 1\.\d* s \(the node-check deadline\)", result.reason
    ), result.reason
    assert_gone(wait_for_pids(pid_file))


def test_device_command_background_child_neither_stalls_nor_outlives_the_check(tmp_path):
    """A child left running with stderr open: the check ends with the shell, and kills the child."""
    pid_file = tmp_path / "pids"
    started = time.monotonic()
    result = DeviceCheck(fake_device("background", str(pid_file)), timeout=20).fsm_agent_node_check(check_round())
    assert result.ok, result.reason
    assert time.monotonic() - started < 10
    assert_gone(wait_for_pids(pid_file))


def test_device_command_killed_by_a_signal():
    result = DeviceCheck("kill -TERM $$", timeout=10).fsm_agent_node_check(check_round())
    assert result.reason == "`kill -TERM $$` killed by signal 15"


# -- options and configuration -----------------------------------------------------------------------


def declared() -> dict[str, Any]:
    """This plugin's options, as the command line collects them from the real plugin manager."""
    registry = collect_options(get_plugin_manager(load_entry_points=False))
    return {option.name: option for option in registry.of(local.PLUGIN_NAME)}


def test_options_flags_env_and_defaults():
    options = declared()
    assert {name: (o.flags, o.env, o.default) for name, o in options.items()} == {
        "disk": (("--node-check-disk",), "FSM_AGENT_NODE_CHECK_DISK", False),
        "disk_min_free_gib": (("--node-check-disk-min-free-gib",), "FSM_AGENT_NODE_CHECK_DISK_MIN_FREE_GIB", 1.0),
        "disk_paths": (("--node-check-disk-paths",), "FSM_AGENT_NODE_CHECK_DISK_PATHS", ""),
        "shm_min_gib": (("--node-check-shm-min-gib",), "FSM_AGENT_NODE_CHECK_SHM_MIN_GIB", 0.0),
        "shm_path": (("--node-check-shm-path",), "FSM_AGENT_NODE_CHECK_SHM_PATH", "/dev/shm"),
        "device_command": (("--node-check-device-command",), "FSM_AGENT_NODE_CHECK_DEVICE_COMMAND", ""),
        "device_timeout": (("--node-check-device-timeout",), "FSM_AGENT_NODE_CHECK_DEVICE_TIMEOUT", 30.0),
    }


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("disk_min_free_gib", "-1", "expected GiB >= 0, got -1.0"),
        ("disk_min_free_gib", "inf", "expected a number, got Infinity"),
        ("shm_min_gib", "-0.5", "expected GiB >= 0, got -0.5"),
        ("device_timeout", "0", "expected seconds > 0, got 0.0"),
        ("disk_min_free_gib", "lots", 'expected a number, got "lots"'),
        ("disk", "maybe", 'expected true or false, got "maybe"'),
    ],
)
def test_bad_values_are_rejected_in_one_line(name, text, message):
    with pytest.raises(Rejected) as caught:
        declared()[name].parse(text)
    assert str(caught.value) == message


@pytest.mark.parametrize("name, text", [("disk_min_free_gib", "0"), ("shm_min_gib", "0"), ("device_timeout", "0.5")])
def test_edge_values_are_accepted(name, text):
    assert declared()[name].parse(text) == float(text)


def config_with(tmp_path: Path, log_dir: bool = True, checkpoint_dir: bool = True, **options) -> LaunchConfig:
    plugins = {local.PLUGIN_NAME: options}
    if checkpoint_dir:
        plugins["checkpoint"] = {"dir": str(tmp_path / "ckpt")}
    return LaunchConfig(log_dir=str(tmp_path / "logs") if log_dir else None, nproc_per_node=3, plugins=plugins)


def test_nothing_is_switched_on_by_default(tmp_path):
    assert local.local_checks(None) == []
    assert local.local_checks(config_with(tmp_path)) == []
    defaults = {name: option.default for name, option in declared().items()}
    assert local.local_checks(config_with(tmp_path, **defaults)) == []


def test_each_check_is_switched_on_by_its_own_option(tmp_path):
    checks = local.local_checks(
        config_with(
            tmp_path,
            disk=True,
            disk_min_free_gib=2.5,
            disk_paths=" /scratch, ,/data ",
            shm_min_gib=8.0,
            shm_path="/run/shm",
            device_command=" nvidia-smi ",
            device_timeout=12.0,
        )
    )
    disk, shm, device = checks
    assert disk.paths == [str(tmp_path / "logs"), str(tmp_path / "ckpt"), "/scratch", "/data"]
    assert disk.min_free_gib == 2.5
    assert (shm.min_gib, shm.path) == (8.0, "/run/shm")
    assert (device.command, device.timeout, device.local_world_size) == ("nvidia-smi", 12.0, 3)


def test_disk_check_without_any_directory_is_not_registered(tmp_path, caplog):
    config = config_with(tmp_path, log_dir=False, checkpoint_dir=False, disk=True)
    assert local.local_checks(config) == []
    assert "--node-check-disk: no --log-dir" in caplog.text


def test_configure_registers_only_the_checks_switched_on_and_they_answer_the_hook(tmp_path):
    """Through the real plugin manager: the built-in plugin, its configure hook, the node-check hook."""
    manager = get_plugin_manager(load_entry_points=False)
    agent = SimpleNamespace(plugin_manager=manager)
    config = config_with(tmp_path, disk=True, disk_min_free_gib=0.0, device_command="true")
    local.fsm_agent_configure(config=config, agent=agent)
    names = {name for name, _ in manager.list_name_plugin() if name.startswith("node-check-local-")}
    assert names == {f"node-check-local-disk-{id(agent)}", f"node-check-local-device-{id(agent)}"}
    results = [r for r in manager.hook.fsm_agent_node_check(check_round=check_round()) if r.check in ("disk", "device")]
    assert sorted((r.check, r.ok) for r in results) == [("device", True), ("disk", True)]
