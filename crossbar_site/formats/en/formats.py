"""How the admin writes dates and times: as the dashboard and the reports do, 24 hours with
seconds (2025-12-01 14:03:07), in the site's zone (`TIME_ZONE`), never "Dec. 1, 2025, 2:03 p.m."."""

DATE_FORMAT = "Y-m-d"
TIME_FORMAT = "H:i:s"
DATETIME_FORMAT = "Y-m-d H:i:s"
SHORT_DATE_FORMAT = "Y-m-d"
SHORT_DATETIME_FORMAT = "Y-m-d H:i:s"
