"""Tests of the HTTP layer (tgis.server) against a FakeEngine."""
