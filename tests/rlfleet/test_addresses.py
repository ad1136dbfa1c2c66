"""Peer addresses named in requests and registrations (rlfleet/wire/addresses.py)."""

import pytest

from rlfleet.errors import InvalidRequest
from rlfleet.wire.addresses import check_address


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1:50051",
        "localhost:1",
        "learner-0.learner.ns.svc:7000",
        "[::1]:9",
        "dns:///svc.ns:80",
        "ipv4:10.0.0.1:8",
        "unix:/tmp/learner.sock",
    ],
)
def test_addresses_are_accepted(address):
    assert check_address(address, "learner_address") == address


@pytest.mark.parametrize(
    "address",
    ["", "x" * 1000, "\x00", "[unclosed: {", "host", "host:0", "host:65536", "a b:1", "unix:", "127.0.0.1:-1"],
)
def test_garbage_is_refused_naming_the_field(address):
    with pytest.raises(InvalidRequest, match=r"^inference_addresses\[2\]: "):
        check_address(address, "inference_addresses[2]")
