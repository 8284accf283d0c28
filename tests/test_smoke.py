def test_placeholder_until_features_land():
    import django

    assert django.VERSION[:2] == (5, 2)
