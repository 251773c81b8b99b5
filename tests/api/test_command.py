"""``rankscope serve`` as a command: what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from rankscope.api.auth import Tokens
from rankscope.cli import main
from rankscope.wire.errors import UsageError
from tests.api.common import READ, WRITE


def test_serve_refuses_an_open_address_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--store", str(tmp_path / "s"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure" in err and not (tmp_path / "s").exists()


def test_tokens_must_be_long_and_scoped(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(f"# ops\n{WRITE} write\n{READ} read\n")
    assert Tokens.load(str(tmp_path / "t"), env="").scope_of(WRITE) == "write"
    with pytest.raises(UsageError, match="16"):
        Tokens.load(None, env="short:read")
    with pytest.raises(UsageError, match="scope"):
        Tokens.load(None, env=f"{READ}:admin")
