// After a link's values landed: press Show and scroll to the first open panel; app/tabs/anatomy/link.py GO_JS.
() => { const q = new URLSearchParams(location.search);
  if (window.lmscopeOpenTab === 'anatomy' && q.get('an_run') === '1') {
    const b = document.querySelector('#anatomy-go'); if (b) b.click();
    const first = (q.get('an_open') || '').split(',').filter(x => x)[0];
    const el = first && document.querySelector('#anatomy-' + first);
    if (el) setTimeout(() => el.scrollIntoView({block: 'start'}), 500); }
  return []; }
