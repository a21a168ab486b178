from check_stub import problems


def test_stub_matches_extension():
    assert problems() == []
