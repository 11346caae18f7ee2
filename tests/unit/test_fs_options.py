"""--fs-option key=value: fsspec storage options from flags and variables, secrets hidden."""

from __future__ import annotations

import pytest

from rollout_agent.config import RolloutConfig
from trainer_agent.config import TrainerConfig
from trainer_agent.settings import PublisherSettings
from weightsync.config import load_config
from weightsync.errors import InvalidArgument
from weightsync.transports.fs import FsStore
from weightsync.transports.fs_options import parse_fs_options, redacted

SENTINEL = "s3cr3t-VALUE-0123"


def test_values_are_typed_except_secrets_and_dotted_keys_nest() -> None:
    options = parse_fs_options(
        [
            "endpoint_url=http://127.0.0.1:9000",
            "requester_pays=true",
            "default_block_size=5242880",
            "secret=0123",
            "client_kwargs.region_name=eu-west-1",
            "config_kwargs.retries.max_attempts=7",
        ]
    )
    assert options == {
        "endpoint_url": "http://127.0.0.1:9000",
        "requester_pays": True,
        "default_block_size": 5242880,
        "secret": "0123",  # a credential stays the text it was given
        "client_kwargs": {"region_name": "eu-west-1"},
        "config_kwargs": {"retries": {"max_attempts": 7}},
    }
    assert redacted(options | {"token": "t", "client_kwargs": {"aws_session_token": "x"}}) == {
        **options,
        "secret": "***",
        "token": "***",
        "client_kwargs": {"aws_session_token": "***"},
    }


@pytest.mark.parametrize(
    ("items", "says"),
    [
        (["endpoint_url"], "is not key=value"),
        (["=x"], "is not key=value"),
        (["a-b=1"], "is not key=value"),
        (["a=1", "a=2"], "given twice"),
        (["a=1", "a.b=2"], "a value and nested keys"),
        (["use_listings_cache=true"], "set by the fs store itself"),
    ],
)
def test_malformed_options_are_refused_naming_the_field(items: list[str], says: str) -> None:
    with pytest.raises(InvalidArgument, match=says) as e:
        parse_fs_options(items)
    assert e.value.field == "fs_option"


def test_a_refused_secret_is_not_echoed() -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_fs_options([f"secret.x{SENTINEL}"])
    assert SENTINEL in str(e.value)  # no '=': nothing says it is a value
    with pytest.raises(InvalidArgument) as e:
        parse_fs_options(["token=a", f"token={SENTINEL}"])
    assert SENTINEL not in str(e.value)


@pytest.mark.parametrize(("cls", "component"), [(TrainerConfig, "trainer"), (RolloutConfig, "rollout")])
def test_every_component_with_fs_root_takes_repeated_options_from_flags_or_env(cls: type, component: str) -> None:
    base = ["--coordinator", "127.0.0.1:1", "--session", "job", "--fs-root", "memory://ws"]
    cfg = load_config(cls, component, [*base, "--fs-option", "a=1", "--fs-option", f"secret={SENTINEL}"], {})
    assert cfg.fs_option == ("a=1", f"secret={SENTINEL}")
    assert SENTINEL not in repr(cfg)  # settings objects are printed in errors and logs
    env = {f"WEIGHTSYNC_{component.upper()}_FS_OPTION": "a=1, b=two"}
    assert load_config(cls, component, base, env).fs_option == ("a=1", "b=two")
    assert load_config(cls, component, [*base, "--fs-option", "c=3"], env).fs_option == ("c=3",)  # the flag wins
    with pytest.raises(SystemExit):
        load_config(cls, component, [*base, "--fs-option", "no-equals"], {})


def test_options_reach_the_filesystem_and_a_malformed_one_is_refused_at_start() -> None:
    assert FsStore("memory://ws-options", {"auto_mkdir": True}).fs.storage_options == {"auto_mkdir": True}
    with pytest.raises(InvalidArgument) as e:
        PublisherSettings(coordinator="127.0.0.1:1", session="job", fs_root="/tmp/x", fs_option=("x",))
    assert e.value.field == "fs_option"
