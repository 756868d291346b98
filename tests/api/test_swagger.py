"""The API's Swagger page needs no internet: its scripts, styles and icon are the console's own files."""
import re

import pytest

pytestmark = pytest.mark.django_db


def test_the_swagger_page_loads_every_asset_from_the_console_itself(admin_client):
    page = admin_client.get("/api/schema/swagger/").content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)

    assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
    for asset in assets:
        assert asset.startswith("/static/"), f"{asset} is not served by the console"
        response = admin_client.get(asset)
        assert response.status_code == 200, asset
        response.close()
