"""The one websocket consumer: subscribe to topics, get their cards now and on every change."""
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from console import live

MAX_TOPICS = 20


class LiveConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if not (user and user.is_authenticated):
            await self.close(code=4401)
            return
        topics = self._topics_asked()
        allowed = topics and await database_sync_to_async(lambda: all(live.may_see(user, t) for t in topics))()
        if not allowed:
            await self.close(code=4403)
            return
        self.topics = topics
        for topic in self.topics:
            await self.channel_layer.group_add(live.group_name(topic), self.channel_name)
        await self.accept()
        # Subscribe first, then render: a change between page load and now is not lost.
        for topic in self.topics:
            for html in await database_sync_to_async(live.render_topic)(topic):
                await self.send(text_data=html)

    def _topics_asked(self) -> list[str]:
        """The topics in the query string; none at all when one is unknown or malformed (``machine:abc``)
        or more than MAX_TOPICS are asked for, so that a refused socket subscribes to nothing."""
        query = parse_qs(self.scope.get("query_string", b"").decode(errors="replace"))
        topics = query.get("topic", [])
        if len(topics) > MAX_TOPICS or not all(live.parse_topic(topic) for topic in topics):
            return []
        return topics

    async def disconnect(self, code):
        for topic in getattr(self, "topics", []):
            await self.channel_layer.group_discard(live.group_name(topic), self.channel_name)

    async def live_html(self, event):
        await self.send(text_data=event["html"])
