"""Tools around the agent: doctor, baseline, the HTTP API client, sd_notify, people's tables."""
