"""Holds libweightsync_native.so, built from native/ by the package build."""
