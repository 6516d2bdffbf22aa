"""Moving bytes: channels, host staging of device buffers, timeouts, topology."""
