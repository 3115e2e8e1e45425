// In <head>: the ?tab= of the link, read before the first tab rewrites the URL; app/server/page.py HEAD_JS.
window.lmscopeOpenTab = new URLSearchParams(location.search).get('tab');
