"""Operations: metrics, the live state of hosts, the dashboard and its history."""
