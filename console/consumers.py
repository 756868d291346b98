"""The one websocket consumer: subscribe to topics, get their cards now and on every change."""
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from console import live, roles

MAX_TOPICS = 20


class LiveConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if not (user and user.is_authenticated):
            await self.close(code=4401)
            return
        query = parse_qs(self.scope.get("query_string", b"").decode())
        self.topics = [t for t in query.get("topic", [])[:MAX_TOPICS] if live.parse_topic(t)]
        allowed = await database_sync_to_async(lambda: all(live.may_see(user, t) for t in self.topics))()
        if not self.topics or not allowed:
            await self.close(code=4403)
            return
        # The cards come rendered for the user's role: its buttons say what that role may press.
        role = await database_sync_to_async(roles.role_of)(user)
        self.groups = [live.group_name(topic, role) for topic in self.topics]
        for group in self.groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        # Subscribe first, then render: a change between page load and now is not lost.
        for topic in self.topics:
            for html in await database_sync_to_async(live.render_topic)(topic, "", role):
                await self.send(text_data=html)

    async def disconnect(self, code):
        for group in getattr(self, "groups", []):
            await self.channel_layer.group_discard(group, self.channel_name)

    async def live_html(self, event):
        await self.send(text_data=event["html"])
