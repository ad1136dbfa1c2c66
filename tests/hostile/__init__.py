"""The hostile-input suite: files and peers that lie (issue 33)."""
