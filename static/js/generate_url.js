// Generate's settings and chosen step into the URL; app/tabs/generate/tab.py GEN_URL_JS.
(model, prompt, chat, ...v) => {
  const keys = __KEYS__;
  const q = new URLSearchParams(location.search);
  q.set('tab', 'generate');
  if (model) q.set('model', model);
  if (prompt !== null && prompt !== undefined) q.set('prompt', prompt);
  q.set('chat', chat ? 1 : 0);
  keys.forEach((k, i) => { const x = v[i];
    if (x !== null && x !== undefined && x !== '') q.set(k, x); else q.delete(k); });
  history.replaceState(null, '', '?' + q.toString());
  return [];
}
