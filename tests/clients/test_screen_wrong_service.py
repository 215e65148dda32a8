"""``so2serve screen --url`` pointed at something that is not the service: a redirect (an
http:// address the host moves to https://) or another service's 200. The run stops with a
sentence naming the address; it used to end in a Python traceback (KeyError, a decode error or
zip's length check) because every status below 400 counted as an answer."""

from __future__ import annotations

import re
from pathlib import Path

import ase.io
import pytest

from clients.screen import ScreenAborted, ScreenOptions, screen
from tests.clients.test_calculators import ONE_H, Script, scripted
from tests.service.fakes import small_molecule

MOVED: Script = [(301, {}, {"Location": "https://example.invalid/evaluate"})]
OTHER_SERVICE: Script = [(200, {"status": "ok"}, {})]


@pytest.mark.parametrize(
    ("script", "message"),
    [
        (MOVED, "answered 301 https://example.invalid/evaluate: --url must name"),
        (OTHER_SERVICE, "not an so2serve answer"),
        ([ONE_H], "answered 1 result(s) for 2 structure(s)"),  # one result for a batch of two
    ],
)
def test_screen_stops_with_a_sentence_when_url_is_not_the_service(
    tmp_path: Path, script: Script, message: str
) -> None:
    source = tmp_path / "in.extxyz"
    ase.io.write(source, [small_molecule("H2O", seed=k) for k in range(2)])
    with scripted(script) as server:
        options = ScreenOptions(
            output_dir=tmp_path / "out", url=server.url, concurrency=1, retries=0, progress=False
        )
        with pytest.raises(ScreenAborted, match=re.escape(message)):
            screen([source], options)
        assert server.attempts == 1
