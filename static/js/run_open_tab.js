// The shared Run button: clicks the open tab's own action (tab_url.js records the open tab); app/server/page.py RUN_JS.
() => {
  // each tab's own action; Fine-tune and Jobs have their own buttons and hide Run (static/page.css),
  // Interventions its own prompts and buttons too
  const targets = {explore: '#explore-run', generate: '#gen-generate', anatomy: '#anatomy-go'};
  const target = targets[window.lmscopeTab || 'explore'];
  const button = target ? document.querySelector(target) : null;
  if (button) button.click();
  return [];
}
