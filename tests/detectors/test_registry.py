"""The detectors' registry (``detectors.DETECTORS``) and ``diagnose.Settings`` agree: each detector's
settings are the field of its name, of its own module's ``Settings`` type, and nothing else is."""

from __future__ import annotations

import sys
from dataclasses import fields

from rankscope.diagnosis.detectors import DETECTORS
from rankscope.diagnosis.diagnose import Settings

GLOBAL = {"min_confidence"}
"""The one setting of the whole diagnosis, no detector's."""


def test_each_detector_has_the_settings_field_of_its_name_and_type() -> None:
    settings = Settings()
    assert [d.name for d in DETECTORS] == [f.name for f in fields(Settings) if f.name not in GLOBAL]
    for d in DETECTORS:
        module = sys.modules[d.find.__module__]
        assert module.__name__.rsplit(".", 1)[-1] == d.name, "a detector's name is its module's"
        assert type(getattr(settings, d.name)) is module.Settings, d.name
