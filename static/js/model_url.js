// After load: a link's ?model= that the menu does not show (the server has no such model) leaves the URL; app/server/page.py MODEL_URL_JS.
(model) => {
  const q = new URLSearchParams(location.search);
  if (q.has('model') && q.get('model') !== model) {
    q.delete('model');
    history.replaceState(null, '', '?' + q.toString());
  }
  return [];
}
