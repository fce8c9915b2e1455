"""REST API of this app: serializers and viewsets, routed in controlplane/api_urls.py."""
