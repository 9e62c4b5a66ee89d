"""Audio output: files and streams (io) and live playback through the speakers (player)."""
