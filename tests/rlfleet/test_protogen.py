from rlfleet.wire import protogen


def test_generated_modules_are_current():
    """Fails when protos/ changed and `python -m rlfleet.wire.protogen` was not run (or a module was hand-edited)."""
    assert protogen.stale_files() == []
